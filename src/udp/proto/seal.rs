//! What guards each datagram: a CRC32C against accidents, or a keyed MAC
//! against forgery.
//!
//! The trailer closes every datagram. Its form is a job-wide choice
//! ([`Guard`]):
//!
//! ```text
//! Crc:  4 bytes  CRC32C of everything before it
//! Mac:  8 bytes  nonce counter (little-endian; the sender's, never reused
//!                under one key)
//!      16 bytes  AES-128-GCM tag over everything before the trailer
//! ```
//!
//! The MAC is AES-GCM's authentication of the datagram's bytes as its
//! plaintext under a per-direction key and the nonce `0u32 ‖ counter`: the
//! sender encrypts a scratch copy of the datagram and sends the datagram in
//! the clear with the tag; the receiver does the same with the counter it
//! read and compares tags in constant time. Forging a tag for bytes never
//! sealed is as hard as forging an AES-GCM ciphertext (the ciphertext is
//! the plaintext XOR a keystream the attacker cannot compute). GCM is used
//! rather than a GMAC over the bytes because the fused AES and GHASH
//! kernels of the encrypting path run several times faster than GHASH over
//! associated data. Keys are per direction and per incarnation of both
//! processes (see the `udp` transport), so a counter counting up from zero
//! never repeats a nonce under one key, and a datagram cannot be reflected
//! back to its sender.
//!
//! Under the MAC every counter is taken once: a receiver keeps the highest
//! it accepted and a bitmap of the [`REPLAY_WINDOW`] below it, and refuses
//! a datagram whose counter it saw or that lies below the window
//! ([`Refused::Replayed`]), so a recorded datagram played back (a keepalive
//! with the BUSY flag, say, which would keep a dead peer looking alive) is
//! dropped and counted. The window is wide because the data and priority
//! sockets overtake each other by up to a socket buffer of datagrams.

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM};

/// Length of the CRC32C trailer.
pub const CRC_TRAILER: usize = 4;
/// Length of the MAC trailer: an 8-byte nonce counter and a 16-byte tag.
pub const MAC_TRAILER: usize = 8 + TAG_LEN;
/// The longest trailer of any guard.
pub const MAX_TRAILER: usize = MAC_TRAILER;
/// Length of a symmetric key of [`Seal::mac`].
pub const KEY_LEN: usize = 16;

const TAG_LEN: usize = 16;

/// Nonce counters below the highest accepted that a receiver still takes
/// (once each); older ones are refused as replays.
pub const REPLAY_WINDOW: u64 = 8192;
const WINDOW_WORDS: usize = (REPLAY_WINDOW / 64) as usize;

/// Why [`Seal::open`] refused a trailer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Not the CRC or MAC of these bytes: corrupted, or forged.
    Forged,
    /// A MAC made by the peer whose counter was already taken, or is
    /// below the replay window: a datagram played back.
    Replayed,
}

/// How a job's datagrams are guarded: every rank of a job uses the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Guard {
    /// A CRC32C: catches corruption, not forgery. The default of a bare
    /// [`Config`](super::Config).
    #[default]
    Crc,
    /// A keyed MAC (AES-128-GCM authentication) with a nonce counter.
    Mac,
}

impl Guard {
    /// Bytes the trailer of this guard takes in every datagram.
    pub const fn trailer_len(self) -> usize {
        match self {
            Guard::Crc => CRC_TRAILER,
            Guard::Mac => MAC_TRAILER,
        }
    }

    /// Its name in settings and reports: `crc` or `mac`.
    pub const fn name(self) -> &'static str {
        match self {
            Guard::Crc => "crc",
            Guard::Mac => "mac",
        }
    }
}

/// A datagram's trailer, as computed by [`Seal::seal`] or read off the wire.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Trailer {
    bytes: [u8; MAX_TRAILER],
    len: u8,
}

impl std::fmt::Debug for Trailer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Trailer({} bytes)", self.len)
    }
}

impl Trailer {
    /// The trailer in `b` (up to [`MAX_TRAILER`] bytes; longer input is
    /// cut, which no guard then accepts).
    pub fn from_slice(b: &[u8]) -> Trailer {
        let n = b.len().min(MAX_TRAILER);
        let mut bytes = [0u8; MAX_TRAILER];
        bytes[..n].copy_from_slice(&b[..n]);
        Trailer {
            bytes,
            len: n as u8,
        }
    }
}

impl AsRef<[u8]> for Trailer {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

/// The guard of one connection, with its keys and nonce counter.
pub struct Seal {
    inner: Inner,
}

enum Inner {
    Crc,
    Mac(Box<MacState>),
}

struct MacState {
    tx: LessSafeKey,
    rx: LessSafeKey,
    /// The next nonce counter to send under `tx`.
    next: u64,
    /// Room for the throw-away ciphertext.
    scratch: Vec<u8>,
    /// The counters taken under `rx`.
    seen: Replay,
}

/// The replay window of one receiving direction.
struct Replay {
    /// One more than the highest counter taken (0: none yet).
    top: u64,
    /// Bit `c % REPLAY_WINDOW` set: counter `c`, within the window, taken.
    bits: Box<[u64; WINDOW_WORDS]>,
}

impl Replay {
    fn new() -> Replay {
        Replay {
            top: 0,
            bits: Box::new([0; WINDOW_WORDS]),
        }
    }

    fn slot(c: u64) -> (usize, u64) {
        let i = c % REPLAY_WINDOW;
        ((i / 64) as usize, 1 << (i % 64))
    }

    /// Whether counter `c` may still be taken.
    fn fresh(&self, c: u64) -> bool {
        if c >= self.top {
            return true;
        }
        if self.top - c > REPLAY_WINDOW {
            return false;
        }
        let (w, b) = Self::slot(c);
        self.bits[w] & b == 0
    }

    /// Take counter `c` (fresh).
    fn take(&mut self, c: u64) {
        if c >= self.top {
            // The slots of the counters the window moves over (top..=c)
            // may hold old ones: clear them.
            if c - self.top >= REPLAY_WINDOW {
                self.bits.fill(0);
            } else {
                for k in self.top..=c {
                    let (w, b) = Self::slot(k);
                    self.bits[w] &= !b;
                }
            }
            self.top = c + 1;
        }
        let (w, b) = Self::slot(c);
        self.bits[w] |= b;
    }
}

impl std::fmt::Debug for Seal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys.
        write!(f, "Seal({})", self.guard().name())
    }
}

impl Seal {
    /// A CRC32C trailer: no key.
    pub fn crc() -> Seal {
        Seal { inner: Inner::Crc }
    }

    /// A MAC trailer: `tx` keys what this side sends, `rx` what it receives
    /// (the peer holds them the other way round). Keys must be fresh for
    /// each connection: the nonce counter starts at zero.
    pub fn mac(tx: &[u8; KEY_LEN], rx: &[u8; KEY_LEN]) -> Seal {
        let key = |k: &[u8; KEY_LEN]| {
            LessSafeKey::new(
                UnboundKey::new(&AES_128_GCM, k)
                    .unwrap_or_else(|_| unreachable!("a 16-byte key suits AES-128-GCM")),
            )
        };
        Seal {
            inner: Inner::Mac(Box::new(MacState {
                tx: key(tx),
                rx: key(rx),
                next: 0,
                scratch: Vec::new(),
                seen: Replay::new(),
            })),
        }
    }

    /// Which guard this is.
    pub fn guard(&self) -> Guard {
        match self.inner {
            Inner::Crc => Guard::Crc,
            Inner::Mac(_) => Guard::Mac,
        }
    }

    /// The trailer of a datagram made of `parts` (joined in order).
    pub fn seal(&mut self, parts: &[&[u8]]) -> Trailer {
        match &mut self.inner {
            Inner::Crc => Trailer::from_slice(&crc32c(parts).to_le_bytes()),
            Inner::Mac(m) => {
                let counter = m.next;
                m.next += 1;
                let tag = gcm_tag(&m.tx, &mut m.scratch, counter, parts);
                let mut bytes = [0u8; MAX_TRAILER];
                bytes[..8].copy_from_slice(&counter.to_le_bytes());
                bytes[8..MAC_TRAILER].copy_from_slice(&tag);
                Trailer {
                    bytes,
                    len: MAC_TRAILER as u8,
                }
            }
        }
    }

    /// Whether `trailer` is the right one for a datagram made of `parts`
    /// that this side has not taken yet; with `take`, its counter is
    /// taken (a datagram acted on), without, only checked (a datagram
    /// looked at now and handed to [`open`](Self::open) later).
    pub fn open(&mut self, parts: &[&[u8]], trailer: &[u8], take: bool) -> Result<(), Refused> {
        match &mut self.inner {
            Inner::Crc if trailer == crc32c(parts).to_le_bytes() => Ok(()),
            Inner::Crc => Err(Refused::Forged),
            Inner::Mac(m) => {
                let Some((counter, tag)) = trailer.split_first_chunk::<8>() else {
                    return Err(Refused::Forged);
                };
                if tag.len() != TAG_LEN {
                    return Err(Refused::Forged);
                }
                let counter = u64::from_le_bytes(*counter);
                let want = gcm_tag(&m.rx, &mut m.scratch, counter, parts);
                // Constant time: every byte is compared whatever differs.
                if want.iter().zip(tag).fold(0u8, |acc, (a, b)| acc | (a ^ b)) != 0 {
                    return Err(Refused::Forged);
                }
                if !m.seen.fresh(counter) {
                    return Err(Refused::Replayed);
                }
                if take {
                    m.seen.take(counter);
                }
                Ok(())
            }
        }
    }

    /// Take the counter of `trailer`, which [`open`](Self::open) accepted
    /// without taking it.
    pub fn take(&mut self, trailer: &[u8]) {
        if let (Inner::Mac(m), Some((counter, _))) =
            (&mut self.inner, trailer.split_first_chunk::<8>())
        {
            let c = u64::from_le_bytes(*counter);
            if m.seen.fresh(c) {
                m.seen.take(c);
            }
        }
    }

    /// Whether `trailer` is the right one for a datagram made of `parts`
    /// ([`open`](Self::open) taking its counter).
    pub fn check(&mut self, parts: &[&[u8]], trailer: &[u8]) -> bool {
        self.open(parts, trailer, true).is_ok()
    }
}

/// CRC-32C (Castagnoli, the iSCSI polynomial) of the joined `parts`:
/// `crc-fast` uses the widest carry-less multiply the CPU has.
fn crc32c(parts: &[&[u8]]) -> u32 {
    let mut d = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    for p in parts {
        d.update(p);
    }
    // A CRC-32 fits in 32 bits; crc-fast returns every width as a u64.
    d.finalize() as u32
}

/// The AES-GCM tag of the joined `parts` as plaintext, no associated data,
/// nonce `0u32 ‖ counter` (little-endian).
fn gcm_tag(
    key: &LessSafeKey,
    scratch: &mut Vec<u8>,
    counter: u64,
    parts: &[&[u8]],
) -> [u8; TAG_LEN] {
    scratch.clear();
    for p in parts {
        scratch.extend_from_slice(p);
    }
    let mut nonce = [0u8; 12];
    nonce[4..].copy_from_slice(&counter.to_le_bytes());
    let tag = key
        .seal_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), scratch)
        // ring refuses only inputs above 64 GiB; a datagram is below 64 KiB.
        .unwrap_or_else(|_| unreachable!("a datagram is far below AES-GCM's input limit"));
    let mut out = [0u8; TAG_LEN];
    out.copy_from_slice(tag.as_ref());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_is_crc32c_of_the_joined_parts() {
        let mut s = Seal::crc();
        let t = s.seal(&[b"1234", b"56789"]);
        assert_eq!(t.as_ref(), 0xE306_9283u32.to_le_bytes());
        assert!(s.check(&[b"123456789"], t.as_ref()));
        assert!(!s.check(&[b"123456788"], t.as_ref()));
    }

    #[test]
    fn mac_checks_with_the_peers_keys_only() {
        let (k1, k2) = ([1u8; KEY_LEN], [2u8; KEY_LEN]);
        let mut a = Seal::mac(&k1, &k2);
        let mut b = Seal::mac(&k2, &k1);
        let t = a.seal(&[b"head", b"payload"]);
        assert_eq!(t.as_ref().len(), MAC_TRAILER);
        assert!(b.check(&[b"headpay", b"load"], t.as_ref()));
        // Every byte of the datagram and of the trailer counts.
        assert!(!b.check(&[b"headpayloae"], t.as_ref()));
        assert!(!b.check(&[b"headpayload!"], t.as_ref()));
        for i in 0..MAC_TRAILER {
            let mut bad = t.as_ref().to_vec();
            bad[i] ^= 0x10;
            assert!(!b.check(&[b"headpayload"], &bad), "byte {i}");
        }
        assert!(!b.check(&[b"headpayload"], &t.as_ref()[..MAC_TRAILER - 1]));
        // A datagram reflected back to its sender fails (keys per direction).
        assert!(!a.check(&[b"headpayload"], t.as_ref()));
        // A wrong key fails.
        let mut c = Seal::mac(&k2, &[3u8; KEY_LEN]);
        assert!(!c.check(&[b"headpayload"], t.as_ref()));
    }

    #[test]
    fn mac_takes_each_counter_once_within_its_window() {
        let (k1, k2) = ([1u8; KEY_LEN], [2u8; KEY_LEN]);
        let mut a = Seal::mac(&k1, &k2);
        let mut b = Seal::mac(&k2, &k1);
        let ts: Vec<Trailer> = (0..10).map(|_| a.seal(&[b"d"])).collect();
        // Out of order is fine, each once; a look without taking leaves it.
        for i in [3, 1, 0, 9, 2] {
            assert_eq!(b.open(&[b"d"], ts[i].as_ref(), false), Ok(()));
            assert_eq!(b.open(&[b"d"], ts[i].as_ref(), true), Ok(()), "{i}");
            assert_eq!(
                b.open(&[b"d"], ts[i].as_ref(), true),
                Err(Refused::Replayed),
                "{i} again"
            );
        }
        assert!(b.check(&[b"d"], ts[5].as_ref()));
        // A forgery is a forgery, not a replay, even on a taken counter.
        let mut bad = ts[3].as_ref().to_vec();
        bad[20] ^= 1;
        assert_eq!(b.open(&[b"d"], &bad, true), Err(Refused::Forged));
        // Far ahead, then what fell below the window is refused, what is
        // inside it still taken once.
        let mut last = ts[9];
        for _ in 0..REPLAY_WINDOW + 5 {
            last = a.seal(&[b"d"]);
        }
        assert!(b.check(&[b"d"], last.as_ref()));
        assert_eq!(
            b.open(&[b"d"], ts[4].as_ref(), true),
            Err(Refused::Replayed)
        );
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(a.seal(&[b"d"]));
        }
        let newest = a.seal(&[b"d"]);
        assert!(b.check(&[b"d"], newest.as_ref()));
        for t in &held {
            assert!(b.check(&[b"d"], t.as_ref()));
            assert!(!b.check(&[b"d"], t.as_ref()));
        }
    }

    #[test]
    fn mac_counts_its_nonces() {
        let mut a = Seal::mac(&[1; KEY_LEN], &[2; KEY_LEN]);
        let t0 = a.seal(&[b"x"]);
        let t1 = a.seal(&[b"x"]);
        assert_eq!(&t0.as_ref()[..8], 0u64.to_le_bytes());
        assert_eq!(&t1.as_ref()[..8], 1u64.to_le_bytes());
        // The same bytes under another nonce get another tag.
        assert_ne!(t0.as_ref()[8..], t1.as_ref()[8..]);
    }
}

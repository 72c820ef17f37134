//! How a transport message `(kind, tag, data)` rides in protocol messages.
//!
//! Small messages are one protocol message: a 9-byte prefix (kind byte, tag
//! as u64 little-endian) followed by the data, copied together. Large ones
//! are two protocol messages, so the user's `Bytes` is sent without a copy:
//! a 17-byte head (kind byte with [`SPLIT`] set, tag, data length) and then
//! the data itself as the next message. The protocol keeps order, so the
//! receiver pairs them.
//!
//! Several small one-part messages may also travel as one protocol message,
//! a *bundle* (built by the driver's `peer::PeerState` while the path to
//! the peer is busy): a [`BUNDLE`] byte, then for each message its
//! one-part encoding's length (u32 little-endian) and that encoding. A
//! bundle is checked whole before any of it is delivered: a malformed one
//! is dropped and counted like any bad frame. Its user messages are copied
//! out (they are small), so a message kept by the program never pins the
//! whole bundle's buffer; protocol messages, consumed at once, are slices.

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};

use crate::core::bufpool::BufPool;

use crate::transport::Kind;

/// Kind-byte bit: the data follows as the next protocol message.
const SPLIT: u8 = 0x80;
/// Kind byte of a bundle of one-part messages.
const BUNDLE: u8 = 0x40;
/// Prefix of a one-part message.
pub(crate) const PREFIX: usize = 9;
/// Bytes a bundle adds per message: the length of its one-part encoding.
pub(crate) const BUNDLE_ENTRY: usize = 4;
/// Length of a split message's head.
const HEAD: usize = 17;
/// Messages at least this large are sent in two parts, without a copy.
/// Below, the copy into a pooled buffer costs less than the head's own
/// datagram would: on loopback a 32 KiB message is one datagram copied, or
/// two sent (with 64 KiB rather than 32 KiB here, 32 KiB messages stream
/// about 1.3x as fast).
pub(crate) const SPLIT_MIN: usize = 64 * 1024;

/// Encode a one-part message (copies `data`). From [`POOL_MIN`] bytes the
/// buffer comes from `pool` and goes back to it when the protocol lets go
/// of the message (acknowledged): a fresh 4–64 KiB allocation per message
/// made the allocator trim and regrow its heap, and the sender spent more
/// time faulting pages in than copying (16 KiB streaming). The pool's
/// classes are powers of two, so the 9-byte prefix puts a power-of-two
/// payload in the next class: a 16 KiB send holds a 32 KiB buffer until it
/// is acknowledged (at most twice the send window's bytes in all).
pub(crate) fn one_part(pool: &Arc<BufPool>, kind: Kind, tag: u64, data: &[u8]) -> Bytes {
    // (Below `POOL_MIN` the pool hands out a plain exact-size `Vec`.)
    let mut b = pool.take(PREFIX + data.len());
    b.push(kind as u8);
    b.extend_from_slice(&tag.to_le_bytes());
    b.extend_from_slice(data);
    pool.freeze(b)
}

/// The protocol messages of one transport message, in order: one, or a
/// head and the data (no `Vec` to allocate per message).
pub(crate) type Parts = (Bytes, Option<Bytes>);

/// Encode a message as the protocol messages to send, in order.
pub(crate) fn encode(pool: &Arc<BufPool>, kind: Kind, tag: u64, data: Bytes) -> Parts {
    if data.len() < SPLIT_MIN {
        return (one_part(pool, kind, tag, &data), None);
    }
    let mut h = BytesMut::with_capacity(HEAD);
    h.put_u8(kind as u8 | SPLIT);
    h.put_u64_le(tag);
    h.put_u64_le(data.len() as u64);
    (h.freeze(), Some(data))
}

/// Small one-part messages being gathered into one protocol message (see
/// the module documentation). Holds its first message as it came, so a
/// bundle of one goes out as that message and allocates nothing; the
/// buffer is made by the second message and grows with the bundle (at
/// most twice what it holds).
#[derive(Debug)]
pub(crate) struct Bundle {
    buf: Vec<u8>,
    first: Bytes,
    count: usize,
}

impl Bundle {
    /// A bundle holding `msg` (a one-part encoding).
    pub(crate) fn new(msg: Bytes) -> Bundle {
        Bundle {
            buf: Vec::new(),
            first: msg,
            count: 1,
        }
    }

    /// Bytes of the bundle as it would be sent with more than one message.
    fn len(&self) -> usize {
        if self.count == 1 {
            1 + BUNDLE_ENTRY + self.first.len()
        } else {
            self.buf.len()
        }
    }

    fn append(buf: &mut Vec<u8>, msg: &[u8]) {
        // One-part encodings that go into bundles are small (see
        // `peer::BUNDLE_ITEM_MAX`): the length fits in a u32.
        buf.extend_from_slice(&(msg.len() as u32).to_le_bytes());
        buf.extend_from_slice(msg);
    }

    /// Add `msg` if the bundle stays within `cap` bytes; else hand it back.
    pub(crate) fn push(&mut self, msg: Bytes, cap: usize) -> Result<(), Bytes> {
        if self.len() + BUNDLE_ENTRY + msg.len() > cap || msg.len() > u32::MAX as usize {
            return Err(msg);
        }
        if self.count == 1 {
            let mut buf = Vec::with_capacity(2 * (self.len() + BUNDLE_ENTRY + msg.len()));
            buf.push(BUNDLE);
            Self::append(&mut buf, &self.first);
            self.buf = buf;
        }
        Self::append(&mut self.buf, &msg);
        self.count += 1;
        Ok(())
    }

    /// Add a one-part message of `kind` and `tag` whose `len` data bytes
    /// `fill` appends, if the bundle stays within `cap` bytes (`None`:
    /// no room, `fill` not called). A `fill` that fails, or appends
    /// another length, leaves the bundle as it was.
    pub(crate) fn push_with(
        &mut self,
        kind: Kind,
        tag: u64,
        len: usize,
        cap: usize,
        fill: &mut dyn FnMut(&mut Vec<u8>) -> crate::Result<()>,
    ) -> Option<crate::Result<()>> {
        let n = PREFIX + len;
        if self.len() + BUNDLE_ENTRY + n > cap || n > u32::MAX as usize {
            return None;
        }
        if self.count == 1 {
            let mut buf = Vec::with_capacity(2 * (self.len() + BUNDLE_ENTRY + n));
            buf.push(BUNDLE);
            Self::append(&mut buf, &self.first);
            self.buf = buf;
        }
        let start = self.buf.len();
        // Undoes the entry unless it is complete, also if `fill` panics (a
        // half-written entry would spoil the whole bundle). A bundle of one
        // keeps `first`; its buffer is rebuilt next time.
        let mut entry = Rollback {
            to: if self.count == 1 { 0 } else { start },
            buf: &mut self.buf,
            keep: false,
        };
        entry.buf.extend_from_slice(&(n as u32).to_le_bytes());
        entry.buf.push(kind as u8);
        entry.buf.extend_from_slice(&tag.to_le_bytes());
        let r = fill(&mut *entry.buf).and_then(|()| {
            if entry.buf.len() == start + BUNDLE_ENTRY + n {
                Ok(())
            } else {
                Err(crate::Error::Misuse(format!(
                    "a message announced as {len} bytes was filled with {}",
                    entry
                        .buf
                        .len()
                        .saturating_sub(start + BUNDLE_ENTRY + PREFIX)
                )))
            }
        });
        entry.keep = r.is_ok();
        drop(entry);
        if r.is_ok() {
            self.count += 1;
        }
        Some(r)
    }

    /// Messages in the bundle.
    #[cfg(test)]
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// The protocol message to send: the first message itself when it is
    /// alone.
    pub(crate) fn finish(self) -> Bytes {
        if self.count == 1 {
            self.first
        } else {
            Bytes::from(self.buf)
        }
    }
}

/// Truncates `buf` back to `to` when dropped, unless told to `keep` it.
struct Rollback<'a> {
    buf: &'a mut Vec<u8>,
    to: usize,
    keep: bool,
}

impl Drop for Rollback<'_> {
    fn drop(&mut self) {
        if !self.keep {
            self.buf.truncate(self.to);
        }
    }
}

/// What one protocol message decoded to.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Frames {
    /// A head was stored: its data comes as the next protocol message.
    Head,
    /// One whole transport message.
    One(Kind, u64, Bytes),
    /// A checked bundle: iterate for its messages, in order.
    Many(Unbundle),
}

/// The messages of a checked bundle, in order.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Unbundle {
    rest: Bytes,
}

impl Iterator for Unbundle {
    type Item = (Kind, u64, Bytes);
    fn next(&mut self) -> Option<Self::Item> {
        use bytes::Buf;
        // Checked whole by `check_bundle`: every entry parses.
        let Entry { kind, tag, len } = entry(&self.rest).ok()??;
        let body = BUNDLE_ENTRY + PREFIX..BUNDLE_ENTRY + len;
        // A user message may be kept by the program: copy it out, so that
        // it does not pin the bundle. Protocol messages (put/get requests
        // and answers, barriers) are consumed at once: a slice.
        let data = if kind == Kind::User {
            Bytes::copy_from_slice(self.rest.get(body)?)
        } else {
            self.rest.slice(body)
        };
        self.rest.advance(BUNDLE_ENTRY + len);
        Some((kind, tag, data))
    }
}

/// A bundle entry's kind and tag, and the length of its one-part encoding.
struct Entry {
    kind: Kind,
    tag: u64,
    len: usize,
}

/// Parse the bundle entry at the start of `b`. `Ok(None)` at the end of
/// the bundle.
fn entry(b: &[u8]) -> Result<Option<Entry>, FrameError> {
    if b.is_empty() {
        return Ok(None);
    }
    let len: [u8; BUNDLE_ENTRY] = b
        .get(..BUNDLE_ENTRY)
        .and_then(|l| l.try_into().ok())
        .ok_or(FrameError::Short)?;
    let len = u32::from_le_bytes(len) as usize;
    let msg = b
        .get(BUNDLE_ENTRY..)
        .and_then(|m| m.get(..len))
        .ok_or(FrameError::BodyLength)?;
    if msg.len() < PREFIX {
        return Err(FrameError::Short);
    }
    let k = msg[0];
    let kind = Kind::from_u8(k).ok_or(FrameError::Kind(k))?;
    let mut tag = [0u8; 8];
    tag.copy_from_slice(&msg[1..PREFIX]);
    Ok(Some(Entry {
        kind,
        tag: u64::from_le_bytes(tag),
        len,
    }))
}

/// Check every entry of a bundle's body.
fn check_bundle(mut b: &[u8]) -> Result<(), FrameError> {
    if b.is_empty() {
        return Err(FrameError::Short);
    }
    while let Some(e) = entry(b)? {
        b = &b[BUNDLE_ENTRY + e.len..];
    }
    Ok(())
}

/// Why a protocol message is not a valid frame. The peer is buggy or
/// hostile; the message is dropped and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameError {
    /// Shorter than its prefix, or a head of the wrong length.
    Short,
    /// Unknown kind byte.
    Kind(u8),
    /// The part after a head does not have the announced length.
    BodyLength,
}

/// Per-peer decoder state: a head waiting for its data.
#[derive(Debug, Default)]
pub(crate) struct Decoder {
    want: Option<(Kind, u64, u64)>,
}

impl Decoder {
    /// Take the next protocol message.
    pub(crate) fn push(&mut self, msg: Bytes) -> Result<Frames, FrameError> {
        if let Some((kind, tag, len)) = self.want.take() {
            if msg.len() as u64 != len {
                return Err(FrameError::BodyLength);
            }
            return Ok(Frames::One(kind, tag, msg));
        }
        if msg.first() == Some(&BUNDLE) {
            check_bundle(&msg[1..])?;
            return Ok(Frames::Many(Unbundle {
                rest: msg.slice(1..),
            }));
        }
        if msg.len() < PREFIX {
            return Err(FrameError::Short);
        }
        let k = msg[0];
        let kind = Kind::from_u8(k & !SPLIT).ok_or(FrameError::Kind(k))?;
        let mut tag = [0u8; 8];
        tag.copy_from_slice(&msg[1..PREFIX]);
        let tag = u64::from_le_bytes(tag);
        if k & SPLIT == 0 {
            return Ok(Frames::One(kind, tag, msg.slice(PREFIX..)));
        }
        if msg.len() != HEAD {
            return Err(FrameError::Short);
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&msg[PREFIX..HEAD]);
        self.want = Some((kind, tag, u64::from_le_bytes(len)));
        Ok(Frames::Head)
    }

    /// Forget a half-received message (peer lost).
    pub(crate) fn reset(&mut self) {
        self.want = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::bufpool::POOL_MIN;
    use proptest::prelude::*;

    fn kinds() -> impl Strategy<Value = Kind> {
        (0u8..15).prop_map(|k| Kind::from_u8(k).unwrap())
    }

    proptest! {
        #[test]
        fn round_trip(kind in kinds(), tag: u64, len in prop_oneof![0usize..100, POOL_MIN - 12..POOL_MIN - 6, SPLIT_MIN - 2..SPLIT_MIN + 2]) {
            let data: Bytes = (0..len).map(|i| i as u8).collect::<Vec<_>>().into();
            let mut d = Decoder::default();
            let (first, second) = encode(&Arc::default(), kind, tag, data.clone());
            let parts: Vec<Bytes> = std::iter::once(first).chain(second).collect();
            let n = parts.len();
            let mut got = None;
            for (i, p) in parts.into_iter().enumerate() {
                let r = d.push(p).unwrap();
                prop_assert_eq!(r != Frames::Head, i + 1 == n);
                got = Some(r);
            }
            prop_assert_eq!(got, Some(Frames::One(kind, tag, data)));
        }

        /// Any run of small messages bundled comes out whole and in order,
        /// and a bundle of one is that message as it was.
        #[test]
        fn bundles_round_trip(msgs in proptest::collection::vec((kinds(), any::<u64>(), proptest::collection::vec(any::<u8>(), 0..64)), 1..20)) {
            let pool = Arc::default();
            let enc: Vec<Bytes> = msgs.iter().map(|(k, t, d)| one_part(&pool, *k, *t, d)).collect();
            let mut b = Bundle::new(enc[0].clone());
            for m in &enc[1..] {
                prop_assert!(b.push(m.clone(), 1 << 16).is_ok());
            }
            prop_assert_eq!(b.count(), msgs.len());
            let wire = b.finish();
            let mut d = Decoder::default();
            let got: Vec<(Kind, u64, Bytes)> = match d.push(wire.clone()).unwrap() {
                Frames::One(k, t, data) => vec![(k, t, data)],
                Frames::Many(it) => it.collect(),
                Frames::Head => vec![],
            };
            let want: Vec<(Kind, u64, Bytes)> = msgs.into_iter().map(|(k, t, d)| (k, t, Bytes::from(d))).collect();
            if want.len() == 1 {
                prop_assert_eq!(&wire, &enc[0]);
            }
            prop_assert_eq!(got, want);
        }

        /// A damaged bundle (a byte changed, bytes cut off or added) never
        /// decodes to part of one: either it is refused, or every byte of
        /// it is accounted for by whole messages.
        #[test]
        fn bundles_are_checked_whole(
            sizes in proptest::collection::vec(0usize..40, 2..6),
            at in any::<prop::sample::Index>(),
            byte: u8,
            how in 0u8..3,
        ) {
            let pool = Arc::default();
            let enc: Vec<Bytes> = sizes.iter().map(|n| one_part(&pool, Kind::User, 7, &vec![1; *n])).collect();
            let mut b = Bundle::new(enc[0].clone());
            for m in &enc[1..] {
                prop_assert!(b.push(m.clone(), 1 << 16).is_ok());
            }
            let mut wire = b.finish().to_vec();
            let i = 1 + at.index(wire.len() - 1);
            match how {
                0 => wire[i] = byte,
                1 => wire.truncate(i),
                _ => wire.insert(i, byte),
            }
            let len = wire.len();
            let mut d = Decoder::default();
            match d.push(Bytes::from(wire)) {
                Ok(Frames::Many(it)) => {
                    let total: usize = it.map(|(_, _, data)| BUNDLE_ENTRY + PREFIX + data.len()).sum();
                    prop_assert_eq!(total + 1, len);
                }
                Ok(other) => prop_assert!(false, "a damaged bundle decoded as {:?}", other),
                Err(_) => {}
            }
        }

        #[test]
        fn any_bytes_decode_without_panic(msgs in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..6)) {
            let mut d = Decoder::default();
            for m in msgs {
                let _ = d.push(Bytes::from(m));
            }
        }
    }

    /// A bundle takes messages up to its cap, then hands the next back;
    /// one that holds a single message is that message, unallocated.
    #[test]
    fn bundles_stop_at_their_cap() {
        let pool = Arc::default();
        let m = one_part(&pool, Kind::User, 1, &[5; 11]); // 20 bytes
        let mut b = Bundle::new(m.clone());
        assert_eq!(b.len(), 1 + 4 + 20);
        assert!(b.buf.capacity() == 0, "a bundle of one allocates nothing");
        let cap = 1 + 3 * (4 + 20);
        assert!(b.push(m.clone(), cap).is_ok());
        assert!(b.push(m.clone(), cap).is_ok());
        assert_eq!(b.len(), cap);
        assert_eq!(b.push(m.clone(), cap), Err(m.clone()));
        assert_eq!(b.count(), 3);
        assert!(b.buf.capacity() <= 2 * cap);
        let one = Bundle::new(m.clone());
        assert_eq!(one.finish(), m);
    }

    #[test]
    fn messages_filled_in_place_join_a_bundle_and_decode() {
        let pool = Arc::new(BufPool::default());
        let mut b = Bundle::new(one_part(&pool, Kind::PutReq, 0, b"first"));
        // A fill that fails, or writes another length, changes nothing
        // (also while the bundle still holds only its first message).
        let r = b.push_with(Kind::PutReq, 0, 3, 1000, &mut |_| Err(crate::Error::Closed));
        assert!(matches!(r, Some(Err(crate::Error::Closed))));
        let r = b.push_with(Kind::PutReq, 0, 3, 1000, &mut |v| {
            v.push(1);
            Ok(())
        });
        assert!(matches!(r, Some(Err(crate::Error::Misuse(_)))));
        let r = b.push_with(Kind::PutReq, 0, 3, 1000, &mut |v| {
            v.extend_from_slice(b"abc");
            Ok(())
        });
        assert!(matches!(r, Some(Ok(()))));
        // No room: not filled.
        let r = b.push_with(Kind::PutReq, 0, 1000, 1000, &mut |_| unreachable!());
        assert!(r.is_none());
        // A fill that panics leaves no half-written entry behind.
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            b.push_with(Kind::PutReq, 0, 4, 1000, &mut |v| {
                v.push(1);
                panic!("fill failed halfway");
            })
        }));
        assert!(panicked.is_err());
        let r = b.push_with(Kind::FlushReq, 5, 0, 1000, &mut |_| Ok(()));
        assert!(matches!(r, Some(Ok(()))));
        let mut d = Decoder::default();
        let Ok(Frames::Many(msgs)) = d.push(b.finish()) else {
            panic!("not a bundle");
        };
        let got: Vec<_> = msgs.collect();
        let want = [
            (Kind::PutReq, 0, Bytes::from_static(b"first")),
            (Kind::PutReq, 0, Bytes::from_static(b"abc")),
            (Kind::FlushReq, 5, Bytes::new()),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn malformed_frames_are_refused() {
        let mut d = Decoder::default();
        assert_eq!(d.push(Bytes::from_static(&[0; 8])), Err(FrameError::Short));
        assert_eq!(
            d.push(Bytes::from_static(&[16; 9])),
            Err(FrameError::Kind(16))
        );
        // A head of the wrong length.
        assert_eq!(
            d.push(Bytes::from_static(&[0x80; 10])),
            Err(FrameError::Short)
        );
        // A head announcing 5 bytes, then 4.
        let mut h = vec![0x80u8];
        h.extend_from_slice(&7u64.to_le_bytes());
        h.extend_from_slice(&5u64.to_le_bytes());
        assert_eq!(d.push(h.into()), Ok(Frames::Head));
        assert_eq!(
            d.push(Bytes::from_static(&[1; 4])),
            Err(FrameError::BodyLength)
        );
        // The decoder is back in sync afterwards.
        let ok = one_part(&Arc::default(), Kind::User, 3, b"x");
        assert_eq!(
            d.push(ok.clone()),
            Ok(Frames::One(Kind::User, 3, Bytes::from_static(b"x")))
        );
        // Bundles: empty, an entry longer than the rest, an entry shorter
        // than a prefix, a split head inside, a good entry then garbage.
        let bundle = |body: &[u8]| {
            let mut m = vec![BUNDLE];
            m.extend_from_slice(body);
            Bytes::from(m)
        };
        let entry = |m: &[u8]| {
            let mut e = (m.len() as u32).to_le_bytes().to_vec();
            e.extend_from_slice(m);
            e
        };
        assert_eq!(d.push(bundle(&[])), Err(FrameError::Short));
        assert_eq!(
            d.push(bundle(&[20, 0, 0, 0, 0])),
            Err(FrameError::BodyLength)
        );
        assert_eq!(d.push(bundle(&entry(&[0; 3]))), Err(FrameError::Short));
        let mut head = vec![0x80u8];
        head.extend_from_slice(&[0; 8]);
        assert_eq!(d.push(bundle(&entry(&head))), Err(FrameError::Kind(0x80)));
        let mut two = entry(&ok);
        two.extend_from_slice(&[1, 2]);
        assert_eq!(d.push(bundle(&two)), Err(FrameError::Short));
        // And a good bundle of two.
        let mut good = entry(&ok);
        good.extend_from_slice(&entry(&ok));
        match d.push(bundle(&good)) {
            Ok(Frames::Many(it)) => assert_eq!(it.count(), 2),
            other => panic!("a good bundle was refused: {other:?}"),
        }
    }
}

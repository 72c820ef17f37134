//! How a transport message `(kind, tag, data)` rides in protocol messages.
//!
//! Small messages are one protocol message: a 9-byte prefix (kind byte, tag
//! as u64 little-endian) followed by the data, copied together. Large ones
//! are two protocol messages, so the user's `Bytes` is sent without a copy:
//! a 17-byte head (kind byte with [`SPLIT`] set, tag, data length) and then
//! the data itself as the next message. The protocol keeps order, so the
//! receiver pairs them.

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};

use crate::bufpool::BufPool;

use crate::transport::Kind;

/// Kind-byte bit: the data follows as the next protocol message.
const SPLIT: u8 = 0x80;
/// Prefix of a one-part message.
pub(crate) const PREFIX: usize = 9;
/// Length of a split message's head.
const HEAD: usize = 17;
/// Messages at least this large are sent in two parts, without a copy.
/// Below, the copy into a pooled buffer costs less than the head's own
/// datagram would: on loopback a 32 KiB message is one datagram copied, or
/// two sent (32 KiB streaming went 2.9 -> 3.7 GB/s when this moved from 32
/// to 64 KiB).
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
    /// Take the next protocol message. `Ok(Some)` is a whole transport
    /// message; `Ok(None)` means a head was stored and its data comes next.
    pub(crate) fn push(&mut self, msg: Bytes) -> Result<Option<(Kind, u64, Bytes)>, FrameError> {
        if let Some((kind, tag, len)) = self.want.take() {
            if msg.len() as u64 != len {
                return Err(FrameError::BodyLength);
            }
            return Ok(Some((kind, tag, msg)));
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
            return Ok(Some((kind, tag, msg.slice(PREFIX..))));
        }
        if msg.len() != HEAD {
            return Err(FrameError::Short);
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&msg[PREFIX..HEAD]);
        self.want = Some((kind, tag, u64::from_le_bytes(len)));
        Ok(None)
    }

    /// Forget a half-received message (peer lost).
    pub(crate) fn reset(&mut self) {
        self.want = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bufpool::POOL_MIN;
    use proptest::prelude::*;

    fn kinds() -> impl Strategy<Value = Kind> {
        (0u8..7).prop_map(|k| Kind::from_u8(k).unwrap())
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
                prop_assert_eq!(r.is_some(), i + 1 == n);
                got = r;
            }
            prop_assert_eq!(got, Some((kind, tag, data)));
        }

        #[test]
        fn any_bytes_decode_without_panic(msgs in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..6)) {
            let mut d = Decoder::default();
            for m in msgs {
                let _ = d.push(Bytes::from(m));
            }
        }
    }

    #[test]
    fn malformed_frames_are_refused() {
        let mut d = Decoder::default();
        assert_eq!(d.push(Bytes::from_static(&[0; 8])), Err(FrameError::Short));
        assert_eq!(
            d.push(Bytes::from_static(&[13; 9])),
            Err(FrameError::Kind(13))
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
        assert_eq!(d.push(h.into()), Ok(None));
        assert_eq!(
            d.push(Bytes::from_static(&[1; 4])),
            Err(FrameError::BodyLength)
        );
        // The decoder is back in sync afterwards.
        let ok = one_part(&Arc::default(), Kind::User, 3, b"x");
        assert_eq!(
            d.push(ok),
            Ok(Some((Kind::User, 3, Bytes::from_static(b"x"))))
        );
    }
}

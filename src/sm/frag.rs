//! The 24-byte header at the start of every shared-memory fragment. The
//! payload follows at [`FRAG_BODY`], the fragment's second cache line.
//!
//! ```text
//! 0  kind   u8     (sm::kind::Kind)
//! 1  flags  u8     FIRST = 1, LAST = 2
//! 2  -      u16    zero
//! 4  len    u32    payload bytes in this fragment
//! 8  tag    u64    user tag, or operation id for RMA kinds
//! 16 total  u64    whole message length (meaningful on FIRST)
//! ```
//!
//! Fragments of one message are pushed back to back on one ring (only the
//! head of a destination's send queue may push), so reassembly needs no
//! message id: the receiver keeps one partial message per sender.

use super::kind::Kind;

/// Bytes of the fragment header.
pub(crate) const FRAG_HEADER: usize = 24;

/// Where a fragment's payload starts: the header has the first cache line
/// to itself, so the payload starts on a line of its own and is copied in
/// and out whole lines at a time, as aligned as the user's buffer.
pub(crate) const FRAG_BODY: usize = 64;

/// First fragment of a message.
pub(crate) const FIRST: u8 = 1;
/// Last fragment of a message.
pub(crate) const LAST: u8 = 2;

/// A decoded fragment header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FragHeader {
    pub(crate) kind: Kind,
    pub(crate) flags: u8,
    pub(crate) len: u32,
    pub(crate) tag: u64,
    pub(crate) total: u64,
}

/// Why a header was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FragError {
    /// Unknown kind byte.
    Kind(u8),
    /// Unknown flag bits or non-zero reserved bytes.
    Flags,
    /// `len` larger than the fragment can hold.
    TooLong,
    /// A single-fragment message whose total differs from its length, or a
    /// first fragment longer than its total.
    Total,
}

impl FragHeader {
    /// Encode.
    pub(crate) fn encode(&self) -> [u8; FRAG_HEADER] {
        let mut b = [0u8; FRAG_HEADER];
        b[0] = self.kind.to_u8();
        b[1] = self.flags;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.total.to_le_bytes());
        b
    }

    /// Decode and check against the fragment's capacity (payload bytes).
    pub(crate) fn decode(b: &[u8; FRAG_HEADER], capacity: usize) -> Result<FragHeader, FragError> {
        let kind = Kind::from_u8(b[0]).ok_or(FragError::Kind(b[0]))?;
        let flags = b[1];
        if flags & !(FIRST | LAST) != 0 || b[2] != 0 || b[3] != 0 {
            return Err(FragError::Flags);
        }
        let len = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let tag = u64::from_le_bytes(b[8..16].try_into().map_err(|_| FragError::Flags)?);
        let total = u64::from_le_bytes(b[16..24].try_into().map_err(|_| FragError::Flags)?);
        if len as usize > capacity {
            return Err(FragError::TooLong);
        }
        if flags & FIRST != 0 && u64::from(len) > total {
            return Err(FragError::Total);
        }
        if flags == FIRST | LAST && u64::from(len) != total {
            return Err(FragError::Total);
        }
        Ok(FragHeader {
            kind,
            flags,
            len,
            tag,
            total,
        })
    }
}

#[cfg(all(test, not(btl_loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn any_bytes_decode_without_panic(b in proptest::array::uniform24(any::<u8>()), cap in 0usize..100_000) {
            if let Ok(h) = FragHeader::decode(&b, cap) {
                prop_assert!(h.len as usize <= cap);
                prop_assert_eq!(h.encode(), b);
            }
        }

        #[test]
        fn round_trip(kind in 0u8..12, flags in 0u8..4, len in 0u32..4096, tag: u64, extra in 0u64..1_000_000) {
            let total = if flags == FIRST | LAST { u64::from(len) } else { u64::from(len) + extra };
            let h = FragHeader { kind: Kind::from_u8(kind).unwrap(), flags, len, tag, total };
            prop_assert_eq!(FragHeader::decode(&h.encode(), 4096), Ok(h));
        }
    }

    #[test]
    fn rejects_lies() {
        let h = FragHeader {
            kind: Kind::User,
            flags: FIRST | LAST,
            len: 10,
            tag: 1,
            total: 10,
        };
        let mut b = h.encode();
        assert_eq!(FragHeader::decode(&b, 8), Err(FragError::TooLong));
        b[16] = 11;
        assert_eq!(FragHeader::decode(&b, 100), Err(FragError::Total));
        b[0] = 99;
        assert_eq!(FragHeader::decode(&b, 100), Err(FragError::Kind(99)));
    }
}

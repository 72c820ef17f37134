//! Datagram wire format.
//!
//! Every datagram is a fixed header, an optional chunk header (DATA only),
//! the payload (DATA) or a list of SACK blocks (ACK-only), and a trailer
//! over everything before it: a CRC32C, or a keyed MAC with its nonce
//! counter (see [`seal`](super::seal)). All integers are little-endian.
//!
//! ```text
//! offset size field
//!      0    4 magic "BTLu"
//!      4    1 version (2; version 1 had no SACK blocks)
//!      5    1 kind: 1 = DATA, 2 = ACK-only
//!      6    2 flags (see Flags)
//!      8    8 job id
//!     16    4 source rank
//!     20    4 destination rank
//!     24    8 sequence number (ACK-only: the sender's next sequence number)
//!     32    8 cumulative ACK: next sequence number expected from the peer
//!     40    4 payload length (ACK-only: bytes of SACK blocks)
//!   ACK-only: 0 to MAX_SACK_BLOCKS SACK blocks of 12 bytes each,
//!      0    8 first sequence number of a run the sender holds
//!      8    4 length of the run (at least 1)
//!   DATA only:
//!     44    8 message id
//!     52    8 chunk offset within the message
//!     60    8 total message length
//!   then the payload, then the trailer: a 4-byte CRC32C of all preceding
//!   bytes, or an 8-byte nonce counter and a 16-byte MAC tag.
//! ```

use super::seal::{Guard, Refused, Seal, Trailer, CRC_TRAILER};
use crate::Rank;

/// The four magic bytes every datagram starts with.
pub const MAGIC: [u8; 4] = *b"BTLu";
/// The wire-format version this code speaks.
pub const VERSION: u8 = 5;
/// Length of the header every datagram carries.
pub const COMMON_LEN: usize = 44;
/// Length of a DATA datagram's headers (common header plus chunk header).
pub const DATA_HEADER_LEN: usize = COMMON_LEN + 24;
/// Length of the CRC32C trailer (the shortest trailer).
pub const CRC_LEN: usize = CRC_TRAILER;
/// The smallest well-formed datagram: an ACK-only packet under a CRC.
pub const MIN_DATAGRAM: usize = COMMON_LEN + CRC_LEN;
/// Most SACK blocks one ACK-only packet carries.
pub const MAX_SACK_BLOCKS: usize = 8;
/// Encoded length of one SACK block.
pub const SACK_BLOCK_LEN: usize = 12;

const KIND_DATA: u8 = 1;
const KIND_ACK: u8 = 2;

/// Where a DATA chunk sits inside its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Chunk {
    /// The message's id, counting up from 0 per direction of a connection.
    pub msg_id: u64,
    /// Offset of this chunk's first byte within the message.
    pub offset: u64,
    /// Length of the whole message.
    pub total_len: u64,
}

/// A run of consecutive sequence numbers the sender of an ACK holds past
/// its cumulative ACK (selective acknowledgement).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SackBlock {
    /// First sequence number of the run.
    pub start: u64,
    /// Number of sequence numbers in the run; at least 1 on the wire.
    pub len: u32,
}

/// Up to [`MAX_SACK_BLOCKS`] SACK blocks, stored inline (no allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Sack {
    n: u8,
    blocks: [SackBlock; MAX_SACK_BLOCKS],
}

impl Sack {
    /// No blocks.
    pub const EMPTY: Sack = Sack {
        n: 0,
        blocks: [SackBlock { start: 0, len: 0 }; MAX_SACK_BLOCKS],
    };

    /// Appends a block; false (and nothing added) when full or `len` is 0.
    pub fn push(&mut self, block: SackBlock) -> bool {
        let n = usize::from(self.n);
        if n >= MAX_SACK_BLOCKS || block.len == 0 {
            return false;
        }
        self.blocks[n] = block;
        self.n += 1;
        true
    }

    /// The blocks, in the order they were pushed.
    pub fn blocks(&self) -> &[SackBlock] {
        &self.blocks[..usize::from(self.n)]
    }

    /// Whether there is no block.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    fn encoded_len(&self) -> usize {
        usize::from(self.n) * SACK_BLOCK_LEN
    }
}

/// What a datagram carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A chunk of a message; consumes one sequence number.
    Data(Chunk),
    /// The cumulative ACK plus SACK blocks; consumes no sequence number.
    Ack(Sack),
}

/// Header flag bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Flags(u16);

impl Flags {
    /// No flag set.
    pub const NONE: Flags = Flags(0);
    /// DATA: the sender asks for an ACK without the delayed-ACK wait (it has
    /// nothing more to send right now, its window is full, or this is a
    /// retransmission).
    pub const ACK_NOW: Flags = Flags(1);
    /// DATA: this segment was sent before (informational).
    pub const RETRANSMIT: Flags = Flags(2);
    /// The sender of this packet holds out-of-order data: its cumulative ACK
    /// points at a hole. Only ACK-only packets with this flag count as
    /// duplicate ACKs.
    pub const GAP: Flags = Flags(4);
    /// DATA: sent on the priority channel, which may overtake the data
    /// channel; arriving early is expected, so on its own it does not make
    /// the receiver send duplicate ACKs.
    pub const PRIORITY: Flags = Flags(8);
    /// ACK-only: the sender is alive but holds back this connection's data
    /// (its application is not reading). The receiver of this packet must
    /// not take the missing ACK progress for a dead path.
    pub const BUSY: Flags = Flags(16);
    const KNOWN: u16 = 1 | 2 | 4 | 8 | 16;

    /// The raw bits.
    pub fn bits(self) -> u16 {
        self.0
    }

    /// Flags from raw bits, or `None` if an unknown bit is set.
    pub fn from_bits(bits: u16) -> Option<Flags> {
        (bits & !Self::KNOWN == 0).then_some(Flags(bits))
    }

    /// Whether every bit of `other` is set in `self`.
    pub fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }

    /// `self` with the bits of `other` added.
    #[must_use]
    pub fn with(self, other: Flags) -> Flags {
        Flags(self.0 | other.0)
    }
}

/// A decoded datagram header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Header {
    /// Job id; datagrams from another job are dropped.
    pub job: u64,
    /// Sending rank.
    pub src: Rank,
    /// Receiving rank.
    pub dst: Rank,
    /// Flag bits.
    pub flags: Flags,
    /// Sequence number (DATA), or the sender's next sequence number (ACK).
    pub seq: u64,
    /// Cumulative ACK: the next sequence number the sender expects.
    pub ack: u64,
    /// DATA with its chunk position, or ACK-only.
    pub kind: Kind,
}

/// Job id and ranks of a datagram, read without verifying the checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PacketIds {
    /// Job id.
    pub job: u64,
    /// Sending rank.
    pub src: Rank,
    /// Receiving rank.
    pub dst: Rank,
}

/// Why a datagram was rejected. Every variant means the whole datagram was
/// dropped; none of it was used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Shorter than the smallest datagram.
    #[error("datagram of {len} bytes is shorter than the {MIN_DATAGRAM}-byte minimum")]
    TooShort {
        /// Its length.
        len: usize,
    },
    /// Does not start with [`MAGIC`]: not an async-btl UDP datagram.
    #[error("bad magic: not an async-btl UDP datagram")]
    BadMagic,
    /// Another wire-format version; both sides must run compatible builds.
    #[error("wire version {0} is not supported (this build speaks {VERSION}): run the same async-btl version on every rank")]
    UnsupportedVersion(u8),
    /// The trailer does not match: the CRC32C (the datagram was corrupted
    /// in flight), or the MAC (corrupted, or forged).
    #[error("checksum mismatch: datagram corrupted in flight, or forged")]
    BadChecksum,
    /// An authentic datagram whose MAC counter was already taken: played
    /// back.
    #[error("replayed datagram: its MAC counter was already taken")]
    Replayed,
    /// Unknown packet kind.
    #[error("unknown packet kind {0}")]
    UnknownKind(u8),
    /// A flag bit this version does not know.
    #[error("unknown flag bits {0:#06x}")]
    UnknownFlags(u16),
    /// The datagram's length disagrees with its payload-length field
    /// (truncated, or trailing bytes).
    #[error("datagram is {actual} bytes but its header says {expected}")]
    LengthMismatch {
        /// Length the header implies.
        expected: u64,
        /// Actual length.
        actual: usize,
    },
    /// Fields that are individually fine but contradict each other.
    #[error("inconsistent header: {0}")]
    Invalid(&'static str),
}

/// A bounds-checked little-endian reader: running out of bytes is an error,
/// never a panic.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let end = self.pos.checked_add(N);
        let bytes =
            end.and_then(|end| self.buf.get(self.pos..end))
                .ok_or(DecodeError::TooShort {
                    len: self.buf.len(),
                })?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        self.pos += N;
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        self.take().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        self.take().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        self.take().map(u64::from_le_bytes)
    }
}

/// Reads magic and version, leaving the reader after them.
fn preamble(buf: &[u8]) -> Result<Reader<'_>, DecodeError> {
    if buf.len() < MIN_DATAGRAM {
        return Err(DecodeError::TooShort { len: buf.len() });
    }
    let mut r = Reader { buf, pos: 0 };
    if r.take::<4>()? != MAGIC {
        return Err(DecodeError::BadMagic);
    }
    let version = r.u8()?;
    if version != VERSION {
        return Err(DecodeError::UnsupportedVersion(version));
    }
    Ok(r)
}

/// Reads job id and ranks without verifying the checksum, so a driver can
/// route a datagram, or drop one from an unknown peer, cheaply. Checks only
/// the length, magic and version; [`decode`] does the full validation.
pub fn peek(buf: &[u8]) -> Result<PacketIds, DecodeError> {
    let mut r = preamble(buf)?;
    r.pos = 8;
    Ok(PacketIds {
        job: r.u64()?,
        src: r.u32()?,
        dst: r.u32()?,
    })
}

/// Decodes and validates one datagram guarded by a CRC, returning its
/// header and payload: [`decode_sealed`] with [`Seal::crc`].
pub fn decode(buf: &[u8]) -> Result<(Header, &[u8]), DecodeError> {
    decode_sealed(buf, &mut Seal::crc())
}

/// Decodes and validates one datagram, returning its header and payload.
///
/// Never panics. Rejects short or long datagrams (trailing bytes included),
/// a wrong magic or version, a trailer `seal` does not accept
/// ([`DecodeError::BadChecksum`]: a CRC mismatch, or a MAC that is not the
/// peer's), unknown kinds or flags, an ACK whose SACK list is not whole
/// blocks, holds more than [`MAX_SACK_BLOCKS`] or an empty block, and a
/// chunk that does not fit in its message.
pub fn decode_sealed<'a>(
    buf: &'a [u8],
    seal: &mut Seal,
) -> Result<(Header, &'a [u8]), DecodeError> {
    decode_opened(buf, seal, true)
}

/// [`decode_sealed`], the MAC counter taken only with `take` (see
/// [`Seal::open`]). A datagram refused later on its contents has its
/// counter taken all the same: it was the peer's, and is spent.
pub(crate) fn decode_opened<'a>(
    buf: &'a [u8],
    seal: &mut Seal,
    take: bool,
) -> Result<(Header, &'a [u8]), DecodeError> {
    let r = preamble(buf)?;
    let trailer = seal.guard().trailer_len();
    if buf.len() < COMMON_LEN + trailer {
        return Err(DecodeError::TooShort { len: buf.len() });
    }
    let (body, tail) = buf.split_at(buf.len() - trailer);
    seal.open(&[body], tail, take).map_err(refusal)?;
    let (header, header_len) = parse(r, buf.len(), seal.guard())?;
    let payload = match header.kind {
        Kind::Data(_) => body
            .get(header_len..)
            .ok_or(DecodeError::TooShort { len: buf.len() })?,
        Kind::Ack(_) => &[],
    };
    Ok((header, payload))
}

fn refusal(r: Refused) -> DecodeError {
    match r {
        Refused::Forged => DecodeError::BadChecksum,
        Refused::Replayed => DecodeError::Replayed,
    }
}

/// The header and payload of a datagram whose trailer of `guard` is left
/// unchecked: for the simulator, which reads what its connections sent.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn decode_unverified(buf: &[u8], guard: Guard) -> Result<(Header, &[u8]), DecodeError> {
    let r = preamble(buf)?;
    let (header, header_len) = parse(r, buf.len(), guard)?;
    let payload = match header.kind {
        Kind::Data(_) => buf
            .get(header_len..buf.len() - guard.trailer_len())
            .ok_or(DecodeError::TooShort { len: buf.len() })?,
        Kind::Ack(_) => &[],
    };
    Ok((header, payload))
}

/// Decodes and validates a DATA datagram that arrived in three places:
/// its first [`DATA_HEADER_LEN`] bytes in `head`, its payload in `payload`
/// and its trailer in `trailer` (a driver that receives the payload
/// straight into a reassembly buffer). The same checks as
/// [`decode_sealed`] on the joined bytes; an ACK-only datagram, or a DATA
/// one whose header is not exactly `head`, is refused (`Invalid`): join the
/// parts and use [`decode_sealed`] for those.
///
/// The MAC counter is checked, not taken: take it with [`Seal::take`] when
/// the datagram is used (a part refused on its position is joined and
/// handled whole, which takes it then).
pub fn decode_parts(
    head: &[u8],
    payload: &[u8],
    trailer: &[u8],
    seal: &mut Seal,
) -> Result<Header, DecodeError> {
    let len = head.len() + payload.len() + trailer.len();
    if len < MIN_DATAGRAM || trailer.len() != seal.guard().trailer_len() {
        return Err(DecodeError::TooShort { len });
    }
    let r = preamble(head)?;
    seal.open(&[head, payload], trailer, false)
        .map_err(refusal)?;
    match parse(r, len, seal.guard())? {
        (
            h @ Header {
                kind: Kind::Data(_),
                ..
            },
            DATA_HEADER_LEN,
        ) if head.len() == DATA_HEADER_LEN => Ok(h),
        _ => Err(DecodeError::Invalid("not a DATA header in its own part")),
    }
}

/// The header after magic and version (`r` is positioned there), checked
/// against the datagram's whole length `len`; returns it with its length
/// (payload and the trailer of `guard` follow).
fn parse(mut r: Reader<'_>, len: usize, guard: Guard) -> Result<(Header, usize), DecodeError> {
    let kind = r.u8()?;
    let flag_bits = r.u16()?;
    let flags = Flags::from_bits(flag_bits).ok_or(DecodeError::UnknownFlags(flag_bits))?;
    let job = r.u64()?;
    let src = r.u32()?;
    let dst = r.u32()?;
    let seq = r.u64()?;
    let ack = r.u64()?;
    let payload_len = r.u32()?;
    let header_len = match kind {
        KIND_DATA => DATA_HEADER_LEN,
        KIND_ACK => COMMON_LEN,
        other => return Err(DecodeError::UnknownKind(other)),
    };
    // Checked before the length comparison so that a huge claimed SACK
    // list is reported as such.
    if kind == KIND_ACK
        && (payload_len as usize % SACK_BLOCK_LEN != 0
            || payload_len as usize > MAX_SACK_BLOCKS * SACK_BLOCK_LEN)
    {
        return Err(DecodeError::Invalid("malformed SACK block list"));
    }
    let expected = (header_len + guard.trailer_len()) as u64 + u64::from(payload_len);
    if expected != len as u64 {
        return Err(DecodeError::LengthMismatch {
            expected,
            actual: len,
        });
    }
    let kind = if kind == KIND_DATA {
        let chunk = Chunk {
            msg_id: r.u64()?,
            offset: r.u64()?,
            total_len: r.u64()?,
        };
        let end = chunk.offset.checked_add(u64::from(payload_len));
        if !matches!(end, Some(end) if end <= chunk.total_len) {
            return Err(DecodeError::Invalid(
                "chunk extends past the end of its message",
            ));
        }
        if payload_len == 0 && chunk.total_len != 0 {
            return Err(DecodeError::Invalid("empty chunk of a non-empty message"));
        }
        Kind::Data(chunk)
    } else {
        let mut sack = Sack::EMPTY;
        for _ in 0..payload_len as usize / SACK_BLOCK_LEN {
            let block = SackBlock {
                start: r.u64()?,
                len: r.u32()?,
            };
            if !sack.push(block) {
                return Err(DecodeError::Invalid("empty SACK block"));
            }
        }
        Kind::Ack(sack)
    };
    let header = Header {
        job,
        src,
        dst,
        flags,
        seq,
        ack,
        kind,
    };
    Ok((header, header_len))
}

impl Header {
    /// Length of the datagram this header makes with `payload_len` bytes
    /// and the trailer of `guard`.
    pub fn encoded_len(&self, payload_len: usize, guard: Guard) -> usize {
        let header = match self.kind {
            Kind::Data(_) => DATA_HEADER_LEN,
            Kind::Ack(sack) => COMMON_LEN + sack.encoded_len(),
        };
        header + payload_len + guard.trailer_len()
    }

    /// Appends the datagram (header, `payload` or SACK blocks, CRC32C) to
    /// `out`: [`encode_sealed`](Self::encode_sealed) with [`Seal::crc`].
    ///
    /// # Panics
    ///
    /// As [`encode_sealed`](Self::encode_sealed).
    pub fn encode(&self, payload: &[u8], out: &mut Vec<u8>) {
        self.encode_sealed(payload, out, &mut Seal::crc());
    }

    /// Appends the datagram (header, `payload` or SACK blocks, the trailer
    /// `seal` makes) to `out`.
    ///
    /// # Panics
    ///
    /// If `payload` is longer than `u32::MAX`, or non-empty on an ACK-only
    /// header: both are bugs in the caller, never caused by peer input.
    pub fn encode_sealed(&self, payload: &[u8], out: &mut Vec<u8>, seal: &mut Seal) {
        let start = out.len();
        self.encode_head(payload.len(), out);
        out.extend_from_slice(payload);
        let t = seal.seal(&[&out[start..]]);
        out.extend_from_slice(t.as_ref());
    }

    /// The same datagram as [`encode_sealed`](Self::encode_sealed), in
    /// three parts for a vectored send, so the payload is never copied:
    /// appends the header (with SACK blocks) to `head` and returns the
    /// trailer; the datagram is `head`'s new bytes, then `payload`, then
    /// the trailer.
    ///
    /// # Panics
    ///
    /// As [`encode_sealed`](Self::encode_sealed).
    pub fn encode_split(&self, payload: &[u8], head: &mut Vec<u8>, seal: &mut Seal) -> Trailer {
        let start = head.len();
        self.encode_head(payload.len(), head);
        // One running digest over both parts (combining two afterwards
        // costs time in proportion to the payload's length).
        seal.seal(&[&head[start..], payload])
    }

    /// Appends everything before the payload.
    fn encode_head(&self, payload_len: usize, out: &mut Vec<u8>) {
        let payload = payload_len;
        assert!(
            matches!(self.kind, Kind::Data(_)) || payload == 0,
            "ACK-only packets carry no payload"
        );
        let payload_len = match self.kind {
            Kind::Data(_) => payload,
            Kind::Ack(sack) => sack.encoded_len(),
        };
        let payload_len = u32::try_from(payload_len).expect("payload longer than u32::MAX");
        out.reserve(self.encoded_len(payload, Guard::Crc) - payload - CRC_LEN);
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(match self.kind {
            Kind::Data(_) => KIND_DATA,
            Kind::Ack(_) => KIND_ACK,
        });
        out.extend_from_slice(&self.flags.bits().to_le_bytes());
        out.extend_from_slice(&self.job.to_le_bytes());
        out.extend_from_slice(&self.src.to_le_bytes());
        out.extend_from_slice(&self.dst.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.ack.to_le_bytes());
        out.extend_from_slice(&payload_len.to_le_bytes());
        match self.kind {
            Kind::Data(c) => {
                out.extend_from_slice(&c.msg_id.to_le_bytes());
                out.extend_from_slice(&c.offset.to_le_bytes());
                out.extend_from_slice(&c.total_len.to_le_bytes());
            }
            Kind::Ack(sack) => {
                for b in sack.blocks() {
                    out.extend_from_slice(&b.start.to_le_bytes());
                    out.extend_from_slice(&b.len.to_le_bytes());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_header() -> impl Strategy<Value = (Header, Vec<u8>)> {
        let data = (any::<u64>(), 0u64..1 << 40, 1usize..300).prop_flat_map(|(id, off, len)| {
            let extra = 0u64..1000;
            (
                Just(id),
                Just(off),
                extra,
                proptest::collection::vec(any::<u8>(), len),
            )
        });
        let kind = prop_oneof![
            data.prop_map(|(msg_id, offset, extra, payload)| {
                let total_len = offset + payload.len() as u64 + extra;
                (
                    Kind::Data(Chunk {
                        msg_id,
                        offset,
                        total_len,
                    }),
                    payload,
                )
            }),
            proptest::collection::vec((any::<u64>(), 1u32..), 0..=MAX_SACK_BLOCKS).prop_map(
                |blocks| {
                    let mut sack = Sack::EMPTY;
                    for (start, len) in blocks {
                        assert!(sack.push(SackBlock { start, len }));
                    }
                    (Kind::Ack(sack), Vec::new())
                }
            ),
        ];
        (any::<(u64, u32, u32, u64, u64)>(), 0u16..16, kind).prop_map(
            |((job, src, dst, seq, ack), flags, (kind, payload))| {
                let flags = Flags::from_bits(flags).unwrap();
                let h = Header {
                    job,
                    src,
                    dst,
                    flags,
                    seq,
                    ack,
                    kind,
                };
                (h, payload)
            },
        )
    }

    fn encoded(h: &Header, payload: &[u8]) -> Vec<u8> {
        let mut buf = Vec::new();
        h.encode(payload, &mut buf);
        buf
    }

    fn crc32c(data: &[u8]) -> u32 {
        u32::from_le_bytes(
            Seal::crc()
                .seal(&[data])
                .as_ref()
                .try_into()
                .expect("4 bytes"),
        )
    }

    #[test]
    fn checksum_is_crc32c() {
        // The check value of CRC-32C, and the empty input.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    proptest! {
        #[test]
        fn split_encoding_is_the_same_datagram((h, payload) in arb_header()) {
            let payload = if matches!(h.kind, Kind::Ack(_)) { Vec::new() } else { payload };
            let mut whole = Vec::new();
            h.encode(&payload, &mut whole);
            let mut head = vec![0xee; 3];
            let crc = h.encode_split(&payload, &mut head, &mut Seal::crc());
            let mut parts = head[3..].to_vec();
            parts.extend_from_slice(&payload);
            parts.extend_from_slice(crc.as_ref());
            prop_assert_eq!(parts, whole);
        }

        #[test]
        fn any_bytes_decode_without_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&bytes);
            let _ = peek(&bytes);
        }

        #[test]
        fn any_bytes_behind_a_valid_ack_preamble_decode_without_panic(
            flags in 0u16..16, claimed in any::<u32>(), blocks in proptest::collection::vec(any::<u8>(), 0..120),
        ) {
            // A well-formed start and a correct checksum, so that the SACK
            // list parser itself sees arbitrary bytes and lengths.
            let mut bytes = Vec::new();
            bytes.extend_from_slice(&MAGIC);
            bytes.push(VERSION);
            bytes.push(KIND_ACK);
            bytes.extend_from_slice(&flags.to_le_bytes());
            bytes.extend_from_slice(&[0u8; 32]);
            let claimed = if claimed % 2 == 0 { blocks.len() as u32 } else { claimed };
            bytes.extend_from_slice(&claimed.to_le_bytes());
            bytes.extend_from_slice(&blocks);
            let crc = crc32c(&bytes);
            bytes.extend_from_slice(&crc.to_le_bytes());
            if let Ok((h, payload)) = decode(&bytes) {
                prop_assert!(payload.is_empty());
                let Kind::Ack(sack) = h.kind else { panic!("not an ACK") };
                prop_assert_eq!(sack.blocks().len() * SACK_BLOCK_LEN, blocks.len());
                prop_assert!(sack.blocks().iter().all(|b| b.len > 0));
            }
            let _ = decode(&bytes);
            let _ = peek(&bytes);
        }

        #[test]
        fn mutated_valid_datagrams_decode_without_panic(
            (h, payload) in arb_header(), at in any::<usize>(), val in any::<u8>(),
        ) {
            let mut buf = encoded(&h, &payload);
            let i = at % buf.len();
            buf[i] = val;
            let _ = decode(&buf);
        }

        #[test]
        fn round_trip((h, payload) in arb_header()) {
            let buf = encoded(&h, &payload);
            prop_assert_eq!(buf.len(), h.encoded_len(payload.len(), Guard::Crc));
            let (got, got_payload) = decode(&buf).unwrap();
            prop_assert_eq!(got, h);
            prop_assert_eq!(got_payload, &payload[..]);
            let ids = peek(&buf).unwrap();
            prop_assert_eq!(ids, PacketIds { job: h.job, src: h.src, dst: h.dst });
        }

        #[test]
        fn trailing_bytes_rejected((h, payload) in arb_header(), extra in proptest::collection::vec(any::<u8>(), 1..16)) {
            let mut buf = encoded(&h, &payload);
            buf.extend_from_slice(&extra);
            prop_assert!(decode(&buf).is_err());
        }

        #[test]
        fn truncation_rejected((h, payload) in arb_header(), cut in 1usize..64) {
            let buf = encoded(&h, &payload);
            let cut = cut.min(buf.len());
            prop_assert!(decode(&buf[..buf.len() - cut]).is_err());
        }

        #[test]
        fn single_bit_flip_rejected((h, payload) in arb_header(), bit in any::<usize>()) {
            let mut buf = encoded(&h, &payload);
            let bit = bit % (buf.len() * 8);
            buf[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(decode(&buf).is_err());
        }
    }

    fn mac_pair() -> (Seal, Seal) {
        let (a, b) = ([7u8; 16], [9u8; 16]);
        (Seal::mac(&a, &b), Seal::mac(&b, &a))
    }

    proptest! {
        #[test]
        fn sealed_round_trip_whole_and_in_parts((h, payload) in arb_header(), bit in any::<usize>()) {
            let payload = if matches!(h.kind, Kind::Ack(_)) { Vec::new() } else { payload };
            let (mut tx, mut rx) = mac_pair();
            let mut buf = Vec::new();
            h.encode_sealed(&payload, &mut buf, &mut tx);
            prop_assert_eq!(buf.len(), h.encoded_len(payload.len(), Guard::Mac));
            let (got, got_payload) = decode_sealed(&buf, &mut rx).unwrap();
            prop_assert_eq!(got, h);
            prop_assert_eq!(got_payload, &payload[..]);
            // In three parts, as a vectored send makes and an in-place
            // receive takes it.
            let mut head = Vec::new();
            let t = h.encode_split(&payload, &mut head, &mut tx);
            if matches!(h.kind, Kind::Data(_)) {
                prop_assert_eq!(decode_parts(&head, &payload, t.as_ref(), &mut rx), Ok(h));
                prop_assert_eq!(
                    decode_parts(&head, &payload, t.as_ref(), &mut Seal::crc()),
                    Err(DecodeError::TooShort { len: buf.len() })
                );
            }
            // Any flipped bit, trailer included, is refused; so is the CRC
            // reading of it, and a seal with other keys.
            let mut bad = buf.clone();
            let bit = bit % (bad.len() * 8);
            bad[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(decode_sealed(&bad, &mut rx).is_err());
            prop_assert!(decode(&buf).is_err());
            prop_assert!(decode_sealed(&buf, &mut tx).is_err());
        }

        #[test]
        fn a_crc_datagram_is_refused_under_a_mac((h, payload) in arb_header()) {
            let buf = encoded(&h, &payload);
            let (_, mut rx) = mac_pair();
            prop_assert!(decode_sealed(&buf, &mut rx).is_err());
        }
    }

    #[test]
    fn checksum_error_has_its_own_variant() {
        let h = Header {
            job: 7,
            src: 1,
            dst: 2,
            flags: Flags::NONE,
            seq: 10,
            ack: 20,
            kind: Kind::Data(Chunk {
                msg_id: 0,
                offset: 0,
                total_len: 3,
            }),
        };
        let mut buf = encoded(&h, b"abc");
        buf[DATA_HEADER_LEN] ^= 0x10; // inside the payload
        assert_eq!(decode(&buf), Err(DecodeError::BadChecksum));
        buf[DATA_HEADER_LEN] ^= 0x10;
        assert!(decode(&buf).is_ok());
        buf[0] ^= 1;
        assert_eq!(decode(&buf), Err(DecodeError::BadMagic));
        assert_eq!(decode(&buf[..10]), Err(DecodeError::TooShort { len: 10 }));
    }

    #[test]
    fn inconsistent_fields_rejected_even_with_a_good_checksum() {
        // Build datagrams by hand with a correct CRC but contradictory fields.
        let reseal = |mut buf: Vec<u8>| {
            let n = buf.len() - CRC_LEN;
            let crc = crc32c(&buf[..n]);
            buf[n..].copy_from_slice(&crc.to_le_bytes());
            buf
        };
        let h = Header {
            job: 1,
            src: 0,
            dst: 1,
            flags: Flags::NONE,
            seq: 0,
            ack: 0,
            kind: Kind::Data(Chunk {
                msg_id: 0,
                offset: 0,
                total_len: 4,
            }),
        };
        let good = encoded(&h, b"abcd");
        let mut bad = good.clone();
        bad[60..68].copy_from_slice(&3u64.to_le_bytes()); // total < offset + len
        assert!(matches!(decode(&reseal(bad)), Err(DecodeError::Invalid(_))));
        let mut bad = good.clone();
        bad[5] = 9; // unknown kind
        assert_eq!(decode(&reseal(bad)), Err(DecodeError::UnknownKind(9)));
        let mut bad = good.clone();
        bad[6] = 0x80; // unknown flag
        assert_eq!(decode(&reseal(bad)), Err(DecodeError::UnknownFlags(0x80)));
        let mut bad = good.clone();
        bad[40..44].copy_from_slice(&5u32.to_le_bytes()); // payload length lies
        assert!(matches!(
            decode(&reseal(bad)),
            Err(DecodeError::LengthMismatch { .. })
        ));
        let mut bad = good;
        bad[52..60].copy_from_slice(&u64::MAX.to_le_bytes()); // offset overflows
        assert!(matches!(decode(&reseal(bad)), Err(DecodeError::Invalid(_))));

        // ACK-only packets: SACK list length and block contents.
        let mut sack = Sack::EMPTY;
        for i in 0..MAX_SACK_BLOCKS as u64 {
            assert!(sack.push(SackBlock {
                start: 10 * i + 5,
                len: 2
            }));
        }
        assert!(!sack.push(SackBlock { start: 99, len: 1 }), "full");
        let ack = Header {
            kind: Kind::Ack(sack),
            ..h
        };
        let good = encoded(&ack, &[]);
        assert_eq!(good.len(), MIN_DATAGRAM + MAX_SACK_BLOCKS * SACK_BLOCK_LEN);
        assert_eq!(decode(&good).unwrap().0, ack);
        let mut bad = good.clone();
        bad[COMMON_LEN + 8..COMMON_LEN + 12].copy_from_slice(&0u32.to_le_bytes()); // empty block
        assert!(matches!(decode(&reseal(bad)), Err(DecodeError::Invalid(_))));
        let mut bad = good.clone();
        bad[40..44].copy_from_slice(&13u32.to_le_bytes()); // not whole blocks
        assert!(matches!(decode(&reseal(bad)), Err(DecodeError::Invalid(_))));
        // One block too many, with the bytes to back it.
        let mut bad = good[..good.len() - CRC_LEN].to_vec();
        bad.extend_from_slice(&[1u8; SACK_BLOCK_LEN + CRC_LEN]);
        let n = ((MAX_SACK_BLOCKS + 1) * SACK_BLOCK_LEN) as u32;
        bad[40..44].copy_from_slice(&n.to_le_bytes());
        assert!(matches!(decode(&reseal(bad)), Err(DecodeError::Invalid(_))));
        let mut bad = good;
        bad[4] = 1; // the previous wire version
        assert_eq!(
            decode(&reseal(bad)),
            Err(DecodeError::UnsupportedVersion(1))
        );
    }
}

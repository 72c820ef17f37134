//! What `rdma` puts in front of every message it sends: a fixed header
//! (version, type, the core's kind, credits returned, sender rank, per-pair
//! sequence number, tag, job id) and, by type, a body.
//!
//! ```text
//!  0      1     2     3     4          8          12         16     24    32
//!  | ver | typ | kind | 0  | credits  | src rank |   seq    |  tag  | job |
//! ```
//!
//! - `Eager`: the message's bytes follow (or the last piece of a message
//!   sent in pieces).
//! - `Part`: a piece of a message too large for one eager buffer; more
//!   pieces follow, in the next sequence numbers, the last an `Eager`.
//! - `Rts` (rendezvous): length, address, key and cookie of the sender's
//!   registered message, which the receiver reads with RDMA read.
//! - `Fin`: the receiver read the message with this cookie.
//! - `Credit`, `Ping`: nothing (a `Ping` keeps a silent pair alive).
//! - `Bundle`: one or more small messages of the header's kind and tag, each
//!   as its length (4 bytes) and its bytes, one after the other to the
//!   end of the frame; at least one.
//!
//! `Eager`, `Part`, `Rts` and `Bundle` carry the sequence number the receiver orders by and
//! use one of the sender's credits; the others do neither. Decoding checks
//! every field and length; the bytes come from the network.

// The encoders serve the transport (built with the `rdma` feature); the
// decoders also the fuzz targets.
#![cfg_attr(not(feature = "rdma"), allow(dead_code))]

/// Bytes of the fixed header.
pub(crate) const HEADER: usize = 32;
/// Bytes of an `Rts` body.
pub(crate) const RTS_BODY: usize = 32;
/// The format version.
pub(crate) const VERSION: u8 = 2;
/// Bytes a `Bundle` frame adds per message: its length.
pub(crate) const ENTRY: usize = 4;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Type {
    /// A whole message.
    Eager = 0,
    /// A large message to read.
    Rts = 1,
    /// A rendezvous message was read.
    Fin = 2,
    /// Credits returned, nothing else.
    Credit = 3,
    /// A keepalive.
    Ping = 4,
    /// A piece of a message; more follow.
    Part = 5,
    /// Small messages of one kind and tag.
    Bundle = 6,
}

impl Type {
    fn from_u8(b: u8) -> Option<Type> {
        Some(match b {
            0 => Type::Eager,
            1 => Type::Rts,
            2 => Type::Fin,
            3 => Type::Credit,
            4 => Type::Ping,
            5 => Type::Part,
            6 => Type::Bundle,
            _ => return None,
        })
    }

    /// Whether frames of this type are ordered and use a credit.
    pub(crate) fn sequenced(self) -> bool {
        matches!(self, Type::Eager | Type::Part | Type::Rts | Type::Bundle)
    }
}

/// Whether an encoded frame (its header, at least) is of a sequenced type.
pub(crate) fn sequenced(frame: &[u8]) -> bool {
    frame
        .get(1)
        .and_then(|b| Type::from_u8(*b))
        .is_some_and(Type::sequenced)
}

/// The fixed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) typ: Type,
    /// The core's message kind (`transport::Kind` as a byte).
    pub(crate) kind: u8,
    /// Credits the sender returns to the receiver.
    pub(crate) credits: u32,
    pub(crate) src: u32,
    pub(crate) seq: u32,
    pub(crate) tag: u64,
    pub(crate) job: u64,
}

/// An `Rts` body: where the sender's message can be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rts {
    pub(crate) len: u64,
    pub(crate) addr: u64,
    pub(crate) key: u64,
    pub(crate) cookie: u64,
}

/// A decoded frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Body<'a> {
    Eager(&'a [u8]),
    Part(&'a [u8]),
    Rts(Rts),
    Fin {
        cookie: u64,
    },
    /// The entries of a `Bundle` frame, checked: iterate them with
    /// [`entries`].
    Bundle(&'a [u8]),
    Empty,
}

/// Why a frame was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WireError {
    Short(usize),
    Version(u8),
    Type(u8),
    Reserved,
    BodyLength { typ: Type, len: usize },
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Short(n) => write!(f, "a frame of {n} bytes is shorter than the header"),
            WireError::Version(v) => write!(f, "format version {v}, not {VERSION}"),
            WireError::Type(t) => write!(f, "unknown frame type {t}"),
            WireError::Reserved => write!(f, "a reserved byte is set"),
            WireError::BodyLength { typ, len } => {
                write!(f, "a {typ:?} frame with a body of {len} bytes")
            }
        }
    }
}

impl Header {
    /// Append the header to `out`.
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&[VERSION, self.typ as u8, self.kind, 0]);
        out.extend_from_slice(&self.credits.to_le_bytes());
        out.extend_from_slice(&self.src.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.tag.to_le_bytes());
        out.extend_from_slice(&self.job.to_le_bytes());
    }

    /// Overwrite the sequence number of an encoded header (a bundle takes
    /// its number when it is closed, not when it was opened).
    pub(crate) fn set_seq(frame: &mut [u8], seq: u32) {
        if let Some(c) = frame.get_mut(12..16) {
            c.copy_from_slice(&seq.to_le_bytes());
        }
    }

    /// Overwrite the credits of an encoded header (filled in when the
    /// frame is posted, not when it was queued).
    pub(crate) fn set_credits(frame: &mut [u8], credits: u32) {
        if let Some(c) = frame.get_mut(4..8) {
            c.copy_from_slice(&credits.to_le_bytes());
        }
    }
}

impl Rts {
    /// Append the body to `out`.
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        for v in [self.len, self.addr, self.key, self.cookie] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Decode a received frame.
pub(crate) fn decode(b: &[u8]) -> Result<(Header, Body<'_>), WireError> {
    if b.len() < HEADER {
        return Err(WireError::Short(b.len()));
    }
    if b[0] != VERSION {
        return Err(WireError::Version(b[0]));
    }
    let typ = Type::from_u8(b[1]).ok_or(WireError::Type(b[1]))?;
    if b[3] != 0 {
        return Err(WireError::Reserved);
    }
    let h = Header {
        typ,
        kind: b[2],
        credits: u32_at(b, 4),
        src: u32_at(b, 8),
        seq: u32_at(b, 12),
        tag: u64_at(b, 16),
        job: u64_at(b, 24),
    };
    let body = &b[HEADER..];
    let bad = || WireError::BodyLength {
        typ,
        len: body.len(),
    };
    let body = match typ {
        Type::Eager => Body::Eager(body),
        Type::Part if !body.is_empty() => Body::Part(body),
        Type::Rts if body.len() == RTS_BODY => Body::Rts(Rts {
            len: u64_at(body, 0),
            addr: u64_at(body, 8),
            key: u64_at(body, 16),
            cookie: u64_at(body, 24),
        }),
        Type::Fin if body.len() == 8 => Body::Fin {
            cookie: u64_at(body, 0),
        },
        Type::Credit | Type::Ping if body.is_empty() => Body::Empty,
        Type::Bundle if well_formed(body) => Body::Bundle(body),
        _ => return Err(bad()),
    };
    Ok((h, body))
}

/// Whether `body` is one or more bundle entries that end exactly at its
/// end.
fn well_formed(body: &[u8]) -> bool {
    let mut at = 0usize;
    while at < body.len() {
        let Some(len) = body.get(at..at + ENTRY).map(|_| u32_at(body, at) as usize) else {
            return false;
        };
        at = match (at + ENTRY).checked_add(len) {
            Some(end) if end <= body.len() => end,
            _ => return false,
        };
    }
    !body.is_empty()
}

/// Append a message to a bundle being built.
pub(crate) fn push_entry(bundle: &mut Vec<u8>, data: &[u8]) {
    bundle.extend_from_slice(&(data.len() as u32).to_le_bytes());
    bundle.extend_from_slice(data);
}

/// Where the messages of a checked bundle body ([`Body::Bundle`]) lie in
/// it, in order: `(offset, length)` pairs.
pub(crate) fn entries(body: &[u8]) -> Entries<'_> {
    Entries { body, at: 0 }
}

/// See [`entries`].
pub(crate) struct Entries<'a> {
    body: &'a [u8],
    at: usize,
}

impl Iterator for Entries<'_> {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        // Checked whole by `decode`; a body that was not stops here.
        let head = self.body.get(self.at..self.at + ENTRY)?;
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let start = self.at + ENTRY;
        let end = start.checked_add(len).filter(|&e| e <= self.body.len())?;
        self.at = end;
        Some((start, len))
    }
}

/// A frame of type `typ` with no sequence-dependent body, for control
/// messages.
pub(crate) fn control(typ: Type, src: u32, job: u64, credits: u32, cookie: Option<u64>) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER + 8);
    Header {
        typ,
        kind: 0,
        credits,
        src,
        seq: 0,
        tag: 0,
        job,
    }
    .encode(&mut v);
    if let Some(c) = cookie {
        v.extend_from_slice(&c.to_le_bytes());
    }
    v
}

/// A key handle: how a peer reaches a region with RDMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Handle {
    /// The provider's key (where keys are requested, the one derived from
    /// the region's id, by the transport's `derived_key`).
    pub(crate) key: u64,
    /// The remote address of the region's first byte (its virtual address
    /// under `FI_MR_VIRT_ADDR`, else 0).
    pub(crate) base: u64,
    /// The registered length.
    pub(crate) len: u64,
    /// Whether `key` was derived from the region's id (the initiator then
    /// derives it itself from the id it was given).
    pub(crate) derived: bool,
}

impl Handle {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(25);
        for w in [self.key, self.base, self.len] {
            v.extend_from_slice(&w.to_le_bytes());
        }
        v.push(u8::from(self.derived));
        v
    }

    pub(crate) fn decode(b: &[u8]) -> Option<Handle> {
        if b.len() != 25 || b[24] > 1 {
            return None;
        }
        let w = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i * 8..i * 8 + 8]);
            u64::from_le_bytes(a)
        };
        Some(Handle {
            key: w(0),
            base: w(1),
            len: w(2),
            derived: b[24] == 1,
        })
    }
}

/// What a process publishes about its `rdma` endpoint.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct RdmaAddr {
    /// The provider (`tcp;ofi_rxm`).
    pub(crate) provider: String,
    /// Its fabric (a network): only ranks on one fabric reach each other.
    pub(crate) fabric: String,
    /// The endpoint's address, as `fi_av_insert` takes it.
    pub(crate) name: Vec<u8>,
    /// The largest eager frame it posts buffers for.
    pub(crate) eager: u32,
    /// The eager buffers it posts for each sender.
    pub(crate) credits: u32,
}

/// Decode a peer's `rdma` address.
pub(crate) fn decode_addr(rank: crate::Rank, addr: &[u8]) -> crate::Result<RdmaAddr> {
    postcard::from_bytes(addr).map_err(|e| {
        crate::Error::Bootstrap(format!(
            "rank {rank} published an unreadable rdma address: {e}"
        ))
    })
}

/// The bytes of a decoded frame, encoded again (what a fuzzer checks
/// against the input).
pub(crate) fn reencode(h: &Header, body: &Body<'_>) -> Vec<u8> {
    let mut v = Vec::new();
    h.encode(&mut v);
    match body {
        Body::Eager(d) | Body::Part(d) | Body::Bundle(d) => v.extend_from_slice(d),
        Body::Rts(r) => r.encode(&mut v),
        Body::Fin { cookie } => v.extend_from_slice(&cookie.to_le_bytes()),
        Body::Empty => {}
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_bad_ones_are_refused() {
        let h = Handle {
            key: 0xfeed,
            base: 0x7f00_1234_0000,
            len: 1 << 20,
            derived: true,
        };
        assert_eq!(Handle::decode(&h.encode()), Some(h));
        let mut b = h.encode();
        b[24] = 2;
        assert_eq!(Handle::decode(&b), None);
        assert_eq!(Handle::decode(&b[..20]), None);
    }

    fn header(typ: Type) -> Header {
        Header {
            typ,
            kind: 3,
            credits: 17,
            src: 5,
            seq: 0xdead_beef,
            tag: u64::MAX - 1,
            job: 0x0123_4567_89ab_cdef,
        }
    }

    #[test]
    fn frames_round_trip() {
        let mut v = Vec::new();
        header(Type::Eager).encode(&mut v);
        v.extend_from_slice(b"hello");
        assert_eq!(decode(&v), Ok((header(Type::Eager), Body::Eager(b"hello"))));
        let rts = Rts {
            len: 1 << 24,
            addr: 0x7f00_0000_1000,
            key: 42,
            cookie: 9,
        };
        let mut v = Vec::new();
        header(Type::Rts).encode(&mut v);
        rts.encode(&mut v);
        assert_eq!(decode(&v), Ok((header(Type::Rts), Body::Rts(rts))));
        let f = control(Type::Fin, 5, 7, 2, Some(99));
        let (h, b) = decode(&f).unwrap();
        assert_eq!((h.typ, h.src, h.job, h.credits), (Type::Fin, 5, 7, 2));
        assert_eq!(b, Body::Fin { cookie: 99 });
        let mut v = Vec::new();
        header(Type::Part).encode(&mut v);
        v.extend_from_slice(b"piece");
        assert_eq!(decode(&v), Ok((header(Type::Part), Body::Part(b"piece"))));
        let mut c = control(Type::Credit, 1, 2, 3, None);
        Header::set_credits(&mut c, 11);
        assert_eq!(decode(&c).unwrap().0.credits, 11);
        Header::set_seq(&mut c, 12);
        assert_eq!(decode(&c).unwrap().0.seq, 12);
    }

    #[test]
    fn bundles_round_trip_and_give_their_messages_in_order() {
        let msgs: [&[u8]; 3] = [b"one", b"", b"three!"];
        let mut v = Vec::new();
        header(Type::Bundle).encode(&mut v);
        for m in msgs {
            push_entry(&mut v, m);
        }
        let (h, b) = decode(&v).unwrap();
        assert_eq!(h, header(Type::Bundle));
        let Body::Bundle(body) = b else {
            panic!("not a bundle: {b:?}")
        };
        let got: Vec<&[u8]> = entries(body).map(|(at, n)| &body[at..at + n]).collect();
        assert_eq!(got, msgs);
        assert_eq!(reencode(&h, &b), v);
        assert!(Type::Bundle.sequenced());
    }

    #[test]
    fn bundles_whose_entries_do_not_end_at_the_end_are_refused() {
        let mut v = Vec::new();
        header(Type::Bundle).encode(&mut v);
        // Empty.
        assert!(matches!(decode(&v), Err(WireError::BodyLength { .. })));
        push_entry(&mut v, b"abc");
        assert!(decode(&v).is_ok());
        // A length running past the end, a cut length, a trailing byte.
        for cut in [1, 2, 5] {
            assert!(matches!(
                decode(&v[..v.len() - cut]),
                Err(WireError::BodyLength { .. })
            ));
        }
        let mut w = v.clone();
        w.push(0);
        assert!(decode(&w).is_err());
        let mut w = v.clone();
        w[HEADER..HEADER + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&w).is_err());
        // Unchecked bytes stop the iterator instead of reading past them.
        assert_eq!(entries(&[9, 0, 0, 0, 1]).count(), 0);
    }

    #[test]
    fn malformed_frames_are_refused() {
        let mut v = Vec::new();
        header(Type::Rts).encode(&mut v);
        assert!(matches!(decode(&v[..10]), Err(WireError::Short(10))));
        assert!(matches!(decode(&v), Err(WireError::BodyLength { .. })));
        let mut w = v.clone();
        w[0] = 9;
        assert_eq!(decode(&w), Err(WireError::Version(9)));
        let mut w = v.clone();
        w[1] = 77;
        assert_eq!(decode(&w), Err(WireError::Type(77)));
        let mut w = v.clone();
        w[3] = 1;
        assert_eq!(decode(&w), Err(WireError::Reserved));
        let mut p = control(Type::Ping, 0, 0, 0, None);
        p.push(0);
        assert!(matches!(decode(&p), Err(WireError::BodyLength { .. })));
        // A piece carries bytes.
        let mut e = Vec::new();
        header(Type::Part).encode(&mut e);
        assert!(matches!(decode(&e), Err(WireError::BodyLength { .. })));
        assert!(Type::Eager.sequenced() && Type::Part.sequenced() && Type::Rts.sequenced());
        assert!(!Type::Fin.sequenced() && !Type::Ping.sequenced());
    }
}

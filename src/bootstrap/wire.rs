//! The TCP rendezvous protocol: length-prefixed postcard frames.
//!
//! ```text
//! server -> client  Hello { version, nonce_s }
//! client -> server  Join { version, rank, size, round, nonce_c, proof_c }
//! server -> client  Accepted { proof_s } | Refused { reason } | Retry
//! client -> server  Blob(bytes)
//! client -> server  Query                      (only after its deadline)
//! server -> client  Missing { ranks }          (answer to Query)
//! server -> client  All(blobs) | Failed { missing }
//! ```
//!
//! `proof_c` = HMAC(key, "join", nonce_s, nonce_c, rank, size, round) shows
//! the client holds the job key; `proof_s` = HMAC(key, "accept", nonce_c,
//! nonce_s, rank, round) shows the server does, before the blob is sent.

use serde::{de::DeserializeOwned, Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::JobKey;

/// Protocol version; bump on any incompatible change.
pub(super) const VERSION: u32 = 1;
/// Largest frame read before the peer proved the key.
pub(crate) const MAX_HANDSHAKE: u32 = 4 << 10;
/// Largest frame read after that (one blob, or all of them).
pub(crate) const MAX_FRAME: u32 = 1 << 30;

/// Messages the server sends.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum ToClient {
    Hello { version: u32, nonce: [u8; 32] },
    Accepted { proof: [u8; 32] },
    Refused { reason: String },
    Retry,
    Missing { ranks: Vec<u32> },
    Failed { missing: Vec<u32> },
    All(Vec<Vec<u8>>),
}

/// Messages the client sends.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum ToServer {
    Join {
        version: u32,
        rank: u32,
        size: u32,
        round: u32,
        nonce: [u8; 32],
        proof: [u8; 32],
    },
    Blob(Vec<u8>),
    Query,
}

pub(super) fn join_proof(
    key: &JobKey,
    ns: &[u8; 32],
    nc: &[u8; 32],
    r: u32,
    s: u32,
    n: u32,
) -> [u8; 32] {
    key.mac(&[
        b"join",
        ns,
        nc,
        &r.to_le_bytes(),
        &s.to_le_bytes(),
        &n.to_le_bytes(),
    ])
}

pub(super) fn accept_proof(key: &JobKey, nc: &[u8; 32], ns: &[u8; 32], r: u32, n: u32) -> [u8; 32] {
    key.mac(&[b"accept", nc, ns, &r.to_le_bytes(), &n.to_le_bytes()])
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum FrameError {
    /// The peer closed the connection cleanly between frames.
    Eof,
    /// I/O error (including a connection reset or a cut-off frame).
    Io(std::io::Error),
    /// The bytes are not a frame of this protocol.
    Malformed(String),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Eof => f.write_str("connection closed"),
            FrameError::Io(e) => write!(f, "{e}"),
            FrameError::Malformed(m) => write!(f, "malformed frame: {m}"),
        }
    }
}

/// Write one frame: a little-endian u32 length, then the postcard bytes.
pub(super) async fn write_frame<W, T>(w: &mut W, msg: &T) -> std::io::Result<()>
where
    W: AsyncWrite + Unpin,
    T: Serialize,
{
    w.write_all(&encode_frame(msg)?).await?;
    w.flush().await
}

/// One frame's bytes: a little-endian u32 length, then the postcard bytes.
pub(crate) fn encode_frame<T: Serialize>(msg: &T) -> std::io::Result<Vec<u8>> {
    let body = postcard::to_allocvec(msg)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let len = u32::try_from(body.len())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "frame over 4 GiB"))?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&body);
    Ok(buf)
}

/// Check a frame's length prefix against the limit `max`.
pub(crate) fn check_len(len: [u8; 4], max: u32) -> Result<usize, FrameError> {
    let len = u32::from_le_bytes(len);
    if len > max {
        return Err(FrameError::Malformed(format!(
            "frame of {len} bytes exceeds the limit of {max}"
        )));
    }
    Ok(len as usize)
}

/// Decode a frame's body: one message and nothing after it.
pub(crate) fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    let (msg, rest) =
        postcard::take_from_bytes(body).map_err(|e| FrameError::Malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(FrameError::Malformed(format!(
            "{} trailing bytes",
            rest.len()
        )));
    }
    Ok(msg)
}

/// Read one frame of at most `max` bytes.
///
/// # Cancel safety
/// Not cancel safe: a partly read frame is lost if the future is dropped.
pub(super) async fn read_frame<R, T>(r: &mut R, max: u32) -> Result<T, FrameError>
where
    R: AsyncRead + Unpin,
    T: DeserializeOwned,
{
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]).await.map_err(FrameError::Io)? {
            0 if got == 0 => return Err(FrameError::Eof),
            0 => return Err(FrameError::Io(std::io::ErrorKind::UnexpectedEof.into())),
            n => got += n,
        }
    }
    let mut body = vec![0u8; check_len(len, max)?];
    r.read_exact(&mut body).await.map_err(FrameError::Io)?;
    decode_body(&body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn any_bytes_decode_without_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let mut framed = (bytes.len() as u32).to_le_bytes().to_vec();
            framed.extend_from_slice(&bytes);
            let _ = rt.block_on(read_frame::<_, ToServer>(&mut framed.as_slice(), MAX_HANDSHAKE));
            let _ = rt.block_on(read_frame::<_, ToClient>(&mut bytes.as_slice(), MAX_HANDSHAKE));
        }
    }

    #[tokio::test]
    async fn round_trip_and_trailing_bytes() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &ToClient::All(vec![vec![1, 2], vec![]]))
            .await
            .unwrap();
        let back: ToClient = read_frame(&mut buf.as_slice(), MAX_FRAME).await.unwrap();
        assert!(matches!(back, ToClient::All(v) if v == vec![vec![1, 2], vec![]]));

        let mut bad = Vec::new();
        write_frame(&mut bad, &ToServer::Query).await.unwrap();
        bad[0] += 1;
        bad.push(0);
        let err = read_frame::<_, ToServer>(&mut bad.as_slice(), MAX_FRAME)
            .await
            .unwrap_err();
        assert!(matches!(err, FrameError::Malformed(m) if m.contains("trailing")));
    }

    #[tokio::test]
    async fn oversized_frame_refused_before_allocation() {
        let huge = u32::MAX.to_le_bytes();
        let err = read_frame::<_, ToServer>(&mut &huge[..], MAX_HANDSHAKE)
            .await
            .unwrap_err();
        assert!(matches!(err, FrameError::Malformed(_)));
    }
}

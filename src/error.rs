//! One error type for the whole crate, split by who is to blame.
//!
//! Every message says what happened and what to do about it. The enum is
//! `#[non_exhaustive]`: match the variants you act on and keep a fallback arm.

use crate::Rank;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in async-btl.
///
/// Variants are grouped by who is to blame:
/// - the peer: [`Error::PeerLost`], [`Error::PeerMisbehaved`];
/// - the caller: [`Error::Misuse`], [`Error::Access`];
/// - this process or node: [`Error::Exhausted`], [`Error::Os`];
/// - the job set-up: [`Error::Config`], [`Error::Bootstrap`];
/// - the lifecycle: [`Error::Closed`], [`Error::Timeout`];
/// - the receiver's choice: [`Error::Declined`].
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The peer died or stopped answering; every pending operation on it
    /// fails with this error.
    #[error("peer rank {rank} is lost ({reason}); its pending operations were failed: stop talking to it or restart the job")]
    PeerLost {
        /// The rank that was lost.
        rank: Rank,
        /// How the loss was noticed.
        reason: String,
    },
    /// The peer sent something malformed or violated the protocol. The data
    /// was dropped and counted; the connection to other peers is unaffected.
    #[error("peer rank {rank} sent bad input ({what}); it was dropped and counted: check that both sides run the same async-btl version")]
    PeerMisbehaved {
        /// The offending rank.
        rank: Rank,
        /// What was wrong.
        what: String,
    },
    /// The caller used the API in a way it does not allow.
    #[error("API misuse: {0}")]
    Misuse(String),
    /// A remote-memory access was refused by the target: unknown or revoked
    /// key, or a range outside the registered region. Target memory was not
    /// touched.
    #[error("remote access refused: {0}")]
    Access(#[from] AccessError),
    /// A local resource ran out (memory, shared-memory space, descriptors).
    #[error("resource exhausted: {what}; {hint}")]
    Exhausted {
        /// What ran out.
        what: String,
        /// What to do about it.
        hint: String,
    },
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Os {
        /// What we were doing.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The job's configuration (environment variables, builder settings) is
    /// inconsistent or incomplete.
    #[error("configuration error: {0}")]
    Config(String),
    /// Address exchange between ranks failed.
    #[error("bootstrap failed: {0}")]
    Bootstrap(String),
    /// The fabric or endpoint was closed before the operation completed.
    #[error("the fabric is closed; open a new one to keep communicating")]
    Closed,
    /// The receiver of a message whose bytes were lent
    /// ([`Endpoint::send_region`](crate::Endpoint::send_region) of device
    /// memory) did not take them: it dropped the message unread, took it
    /// with a receive that takes only carried bytes, or its copy failed.
    #[error("rank {rank} did not take the bytes of the lent message: {why}")]
    Declined {
        /// The receiver.
        rank: Rank,
        /// What it said.
        why: String,
    },
    /// An operation did not complete in the configured time.
    #[error("timed out after {after:?} while {what}")]
    Timeout {
        /// What we were waiting for.
        what: String,
        /// How long we waited.
        after: std::time::Duration,
    },
}

/// Why a put/get was refused (by the initiator's own checks or by the target).
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum AccessError {
    /// The key is not (or no longer) registered at the target.
    #[error("unknown or revoked remote key: ask the owner for a fresh key")]
    UnknownKey,
    /// The byte range falls outside the registered region.
    #[error("range {offset}..{end} is outside the region of {len} bytes")]
    OutOfBounds {
        /// Requested start.
        offset: u64,
        /// Requested end (exclusive).
        end: u64,
        /// Region length.
        len: u64,
    },
    /// The key belongs to another rank than the endpoint it was used on.
    #[error("the key belongs to rank {owner}, not to this endpoint's rank {endpoint}")]
    WrongOwner {
        /// The key's owner.
        owner: Rank,
        /// The endpoint's peer.
        endpoint: Rank,
    },
    /// The region does not allow this kind of access.
    #[error("the region does not allow {0}")]
    NotPermitted(String),
    /// An atomic operation's word is not 8-byte aligned in memory (its
    /// offset, or the region's start address, is not a multiple of 8).
    #[error("the atomic word at offset {offset} is not 8-byte aligned")]
    Misaligned {
        /// The requested offset in the region.
        offset: u64,
    },
}

impl Error {
    /// Wrap an I/O error with what we were doing.
    pub fn os(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Os {
            context: context.into(),
            source,
        }
    }

    /// The last OS error, with context.
    pub fn last_os(context: impl Into<String>) -> Self {
        Self::os(context, std::io::Error::last_os_error())
    }

    /// Whether this error means the peer is gone.
    pub fn is_peer_lost(&self) -> bool {
        matches!(self, Error::PeerLost { .. })
    }
}

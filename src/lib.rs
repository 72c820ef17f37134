//! # async-btl
//!
//! An async byte-transfer layer in the spirit of Open MPI's BTLs: a process
//! opens a [`Fabric`], takes an [`Endpoint`] per peer and awaits `send`, `put`
//! and `get`. Every operation is a future completed by the transport's own
//! progress task.
#![deny(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod error;
pub mod udp;

pub use error::{AccessError, Error, Result};

/// A process's index in the job, `0..size`.
pub type Rank = u32;

/// A message tag: receivers subscribe per tag; order is kept per (sender, tag).
pub type Tag = u64;

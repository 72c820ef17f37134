//! # async-btl
//!
//! An async byte-transfer layer in the spirit of Open MPI's BTLs: a process
//! opens a [`Fabric`], takes an [`Endpoint`] per peer and awaits `send`, `put`
//! and `get`. Every operation is a future completed by the transport's own
//! progress task; backpressure is `Poll::Pending`, never `EAGAIN`.
//!
//! ```no_run
//! # async fn demo() -> async_btl::Result<()> {
//! use async_btl::{Fabric, LocalExchange, FabricBuilder};
//! let fabric = Fabric::single().await?;
//! let ep = fabric.endpoint(0)?;
//! let mut rx = fabric.receiver(7)?;
//! ep.send(7, &b"hello"[..]).await?;
//! let msg = rx.recv().await?;
//! assert_eq!(&msg.data[..], b"hello");
//! fabric.close().await
//! # }
//! ```
#![deny(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

#[cfg(not(btl_loom))]
#[doc(hidden)]
pub mod bench_support;
pub mod bootstrap;
pub mod config;
pub mod error;
pub mod exchange;
pub mod info;
pub mod launch;
pub mod udp;

mod core;
pub(crate) mod sm;
mod sys;
mod transport;

pub use crate::core::dispatch::{Message, Receiver};
pub use crate::core::endpoint::{AtomicFetch, Endpoint, Flush, Get, Put, Send, SendInline};
pub use crate::core::fabric::{Fabric, FabricBuilder, MemoryKind};
pub use crate::core::region::{MemoryRegion, PageBuf, RegisterMemory, RemoteKey};
pub use crate::core::stats::Stats;
pub use crate::sys::mem::CopyChoice;
pub use config::{Config, CopyMode, ProgressMode};
pub use error::{AccessError, Error, Result};
pub use exchange::{AddressExchange, JobExchange, LocalExchange};
pub use sm::config::SmConfig;
pub use sm::stats::SmStats;
pub use udp::config::UdpConfig;
pub use udp::stats::UdpStats;

/// A process's index in the job, `0..size`.
pub type Rank = u32;

/// A message tag: receivers subscribe per tag; order is kept per (sender, tag).
pub type Tag = u64;

//! # async-btl
//!
//! An async byte-transfer layer in the spirit of Open MPI's BTLs: a process
//! opens a [`Fabric`], takes an [`Endpoint`] per peer and awaits `send`, `put`
//! and `get`. Every operation is a future completed by the transport's own
//! progress task; backpressure is `Poll::Pending`, never `EAGAIN`. Peers on
//! one node talk through shared memory (`sm`), peers elsewhere through a
//! reliable protocol on UDP (`udp`), and a process to itself through `self`.
//!
//! ## A first program
//!
//! Every rank sends a greeting to the next rank and prints the one it
//! receives. Start it with `btl-run -n 4 target/release/my-app` (the
//! `btl-tools` package), `mpirun -np 4 …`, `srun`, or torchrun's variables;
//! started by hand it is a job of one that talks to itself.
//!
//! ```no_run
//! use async_btl::{Fabric, Result};
//!
//! #[tokio::main]
//! async fn main() -> Result<()> {
//!     let fabric = Fabric::from_env().await?; // rank, size, rendezvous from the launcher
//!     let next = (fabric.rank() + 1) % fabric.size();
//!     let ep = fabric.endpoint(next)?; // sm on this node, udp across nodes
//!     let mut rx = fabric.receiver(1)?; // the messages sent to this rank on tag 1
//!
//!     ep.send(1, format!("hello from rank {}", fabric.rank())).await?;
//!     let msg = rx.recv().await?;
//!     println!("rank {} got {:?} from rank {}", fabric.rank(), msg.data, msg.src);
//!
//!     fabric.barrier().await?;
//!     fabric.close().await // drains, says goodbye, removes shared memory
//! }
//! ```
//!
//! One-sided operations work on registered memory: register a buffer, send
//! its [`RemoteKey`] to the peers, and they `put` into it or `get` from it.
//! In a job of one the peer is the process itself:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> async_btl::Result<()> {
//! use async_btl::Fabric;
//!
//! let fabric = Fabric::single().await?;
//! let target = fabric.alloc_region(64)?; // what peers may write into
//! let key = target.remote_key(); // serialisable: send it to them
//!
//! let source = fabric.register(vec![7u8; 64]);
//! let ep = fabric.endpoint(key.owner())?;
//! ep.put(&source, 0..64, &key, 0).await?; // resolves once the bytes are in `target`
//! ep.get(&source, 0..8, &key, 56).await?; // and back again
//! fabric.close().await
//! # }
//! ```
//!
//! ## What the futures promise
//!
//! - **Completion.** [`Endpoint::send`] resolves at local completion: the
//!   buffer is no longer needed and the message cannot be lost by this
//!   process (it is in the peer's shared-memory FIFO, or in `udp`'s
//!   retransmit storage). [`Endpoint::put`], [`Endpoint::get`] and the
//!   atomics resolve at remote completion: the bytes are in the target's
//!   memory, or read back into ours. [`Endpoint::flush`] resolves when
//!   every one-sided operation started before it has.
//! - **Ordering.** Messages from one sender on one tag arrive in send order,
//!   on every transport. Nothing is promised across tags or senders, nor
//!   between messages and one-sided operations: await a put (or flush)
//!   before sending the message that tells the peer to look.
//! - **Cancellation.** An operation is started when its future is first
//!   polled (a message) or made (a put, get or atomic). Dropping the future
//!   afterwards never frees memory a peer or the kernel may still touch and
//!   never loses a started message; it only loses the result. Each future
//!   says so in its `# Cancel safety` section.
//! - **Failure.** When a peer dies, every pending operation on it fails
//!   with [`Error::PeerLost`] within a bounded time, and each open
//!   [`Receiver`] yields that error once; the other peers carry on.
//!
//! ## Runtimes
//!
//! A fabric lives on the tokio runtime that creates it: its progress tasks
//! are spawned there and park on its I/O driver and timers, so build the
//! runtime with both (`#[tokio::main]`, or `Builder::enable_all`). Both
//! flavours are meant:
//!
//! - **Multi-thread** (the default of `#[tokio::main]`): progress tasks and
//!   the caller's tasks run side by side; the usual choice for a service.
//! - **Current-thread** (`flavor = "current_thread"`, one core per rank as
//!   under `mpirun` binding): everything shares one thread. Operations that
//!   complete at once still spend tokio's cooperative budget, and a waiter
//!   that polls hot gives way to the runtime's other I/O and timers every few
//!   polls, so a TCP socket or a ticker beside a busy fabric is served
//!   promptly.
//!
//! On either, peer liveness does not depend on the caller's tasks: a small
//! watchdog thread per fabric checks peers when the progress tasks have not
//! run for a few heartbeats, so a loop that never yields still sees
//! [`Error::PeerLost`] (a single-threaded process may do without the
//! thread: see [`Liveness`]). `BTL_PROGRESS=interrupt` (no spinning) suits a rank
//! that shares its core with other busy work.
//!
//! ## Configuration and logs
//!
//! [`Config::from_env`] reads the `BTL_*` variables (README, "Configuration").
//! The crate logs through `tracing`: install a subscriber (for example
//! `tracing_subscriber::fmt()` with an `EnvFilter` reading `RUST_LOG`) to
//! see warnings such as a lost peer or a connection the rendezvous refused,
//! and at `debug` the launcher found and the route chosen per peer.
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(clippy::undocumented_unsafe_blocks)]

#[cfg(not(btl_loom))]
#[doc(hidden)]
pub mod bench_support;
pub mod bootstrap;
pub mod config;
pub mod error;
pub mod exchange;
#[cfg(not(btl_loom))]
#[doc(hidden)]
pub mod fuzz_support;
/// The GPU check of `smcuda`'s GPU layer between two processes, for
/// `btl-gpu-check`. Not part of the supported API.
#[doc(hidden)]
pub mod gpu_check {
    pub use crate::smcuda::check::{child, run, Bandwidth, ModeReport, Options, Report};
}
pub mod info;
pub mod launch;
pub mod udp;

mod core;
pub(crate) mod rdma;
pub(crate) mod sm;
pub(crate) mod smcuda;
mod sys;
mod transport;

pub use crate::core::dispatch::{Message, Receiver, RecvInto};
pub use crate::core::endpoint::{
    AtomicFetch, Endpoint, Flush, Get, Put, SendFuture, SendInlineFuture, SendRegion, SendSink,
};
pub use crate::core::fabric::{Fabric, FabricBuilder, MemoryKind};
pub use crate::core::region::{MemoryRegion, PageBuf, RegisterMemory, RemoteKey};
pub use crate::core::stats::Stats;
pub use crate::sys::mem::CopyChoice;
pub use config::{Config, CopyMode, Liveness, ProgressMode};
pub use error::{AccessError, Error, Result};
pub use exchange::{AddressExchange, JobExchange, LocalExchange};
pub use rdma::config::RdmaConfig;
pub use rdma::stats::RdmaStats;
pub use sm::config::SmConfig;
pub use sm::stats::SmStats;
pub use udp::config::UdpConfig;
pub use udp::stats::UdpStats;

/// A process's index in the job, `0..size`.
pub type Rank = u32;

/// A message tag: receivers subscribe per tag; order is kept per (sender, tag).
pub type Tag = u64;

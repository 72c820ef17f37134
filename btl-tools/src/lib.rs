//! # btl-tools
//!
//! The command-line tools of [async-btl](async_btl), and the modules behind
//! them:
//! - `btl-run`, the local launcher: a command line over
//!   [`async_btl::launch::LocalJob`].
//! - `btl-info`: what works on this host ([`async_btl::info`]) and the CPU
//!   topology ([`info`]).
//! - `btl-perf`: point-to-point benchmarks over async-btl and socket, Open
//!   MPI and UCX baselines ([`perf`]).
//!
//! They live in their own package so that an application depending on
//! async-btl builds none of their command-line, plotting or benchmark
//! crates. Install them with `cargo install --path btl-tools` from the
//! repository.
#![deny(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod info;
pub mod perf;

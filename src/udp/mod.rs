//! The `udp` transport: the usNIC reliability protocol carried over plain UDP.
//!
//! [`proto`] is the sans-IO protocol engine (no sockets, no clock); a thin
//! tokio driver on top of it owns the sockets and timers.
pub mod proto;

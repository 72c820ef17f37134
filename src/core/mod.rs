//! The transport-independent core: the fabric and its endpoints, the
//! operation futures and their completion slots, tag dispatch and receive
//! budgets, registered regions and keys, the emulated one-sided operations,
//! progress, and the counters. Transports reach it only through the
//! methods of [`fabric::Core`] listed in `crate::transport`'s docs.

pub(crate) mod bufpool;
pub(crate) mod completion;
pub(crate) mod dispatch;
pub(crate) mod endpoint;
pub(crate) mod fabric;
pub(crate) mod lend;
pub(crate) mod progress;
pub(crate) mod region;
pub(crate) mod rma;
pub(crate) mod stats;

//! Operating-system and memory primitives, shared by the core and the
//! transports: system calls (`os`), sealed shared memory (`shm`), passing
//! descriptors between processes (`fdpass`), raw
//! memory ranges and copies (`mem`), lock-free rings (`ring`), and the
//! synchronisation primitives loom models replace (`sync`). Most of the
//! crate's `unsafe` lives here.

pub(crate) mod env;
pub(crate) mod fdpass;
pub(crate) mod mem;
pub(crate) mod os;
pub(crate) mod ring;
pub(crate) mod shm;
pub(crate) mod sync;

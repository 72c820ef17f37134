//! Doorbells: how a sender wakes a parked receiver.
//!
//! Each process binds a Unix datagram socket in the abstract namespace under
//! a random name and publishes the name. A sender rings (sends one byte) only
//! when the receiver's `armed` word says it is asleep, so hot traffic makes no
//! system call at all. Abstract sockets have no file permissions: a stranger
//! who guessed the 128-bit name could only cause a spurious wake-up.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram as StdDatagram};
use std::time::Duration;

use tokio::net::UnixDatagram;

use crate::sys::os;
use crate::{Error, Result};

/// Our doorbell: the socket we sleep on.
pub(crate) struct Doorbell {
    sock: UnixDatagram,
    name: Vec<u8>,
}

impl Doorbell {
    /// Bind a fresh doorbell. Needs a tokio runtime.
    pub(crate) fn new() -> Result<Doorbell> {
        let name = format!("abtl-bell-{}", os::hex(&os::random_bytes::<16>())).into_bytes();
        let addr =
            SocketAddr::from_abstract_name(&name).map_err(|e| Error::os("doorbell name", e))?;
        let std =
            StdDatagram::bind_addr(&addr).map_err(|e| Error::os("binding doorbell socket", e))?;
        std.set_nonblocking(true)
            .map_err(|e| Error::os("doorbell socket non-blocking", e))?;
        let sock = UnixDatagram::from_std(std).map_err(|e| Error::os("registering doorbell", e))?;
        Ok(Doorbell { sock, name })
    }

    /// The abstract name to publish.
    pub(crate) fn name(&self) -> &[u8] {
        &self.name
    }

    /// Sleep until rung or `timeout`, then drain pending rings.
    pub(crate) async fn wait(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.sock.readable()).await;
        let mut b = [0u8; 16];
        while self.sock.try_recv(&mut b).is_ok() {}
    }
}

/// A peer's doorbell, rung from a shared unbound socket.
pub(crate) struct Bell {
    addr: SocketAddr,
}

impl Bell {
    /// Address a peer's doorbell by its published name.
    pub(crate) fn new(name: &[u8]) -> Result<Bell> {
        let addr =
            SocketAddr::from_abstract_name(name).map_err(|e| Error::os("peer doorbell name", e))?;
        Ok(Bell { addr })
    }

    /// Ring it; a full socket buffer means it is already ringing.
    pub(crate) fn ring(&self, via: &StdDatagram) {
        let _ = via.send_to_addr(&[1], &self.addr);
    }
}

/// The socket senders ring through.
pub(crate) fn ringer() -> Result<StdDatagram> {
    let s = StdDatagram::unbound().map_err(|e| Error::os("doorbell sender socket", e))?;
    s.set_nonblocking(true)
        .map_err(|e| Error::os("doorbell sender non-blocking", e))?;
    Ok(s)
}

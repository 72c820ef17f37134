//! Host facts the driver needs: which IPv4 address to bind, the MTU of the
//! path to a peer, and sockets with large buffers.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use socket2::{Domain, Protocol, Socket, Type};

use crate::{Error, Result};

/// Bytes of IPv4 and UDP headers in front of a UDP payload.
pub(crate) const IP_UDP_HEADERS: usize = 28;
/// Largest UDP payload over IPv4.
pub(crate) const MAX_PAYLOAD: usize = 65_507;
/// Socket buffer size we ask for (forced past `rmem_max` when root).
const WANT_BUF: usize = 8 << 20;

/// One IPv4 address of an interface that is up.
#[derive(Debug, Clone)]
pub(crate) struct Iface {
    pub(crate) name: String,
    pub(crate) addr: Ipv4Addr,
    pub(crate) loopback: bool,
}

/// The IPv4 addresses of the interfaces that are up.
pub(crate) fn interfaces() -> Vec<Iface> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `head` and returns 0, or
    // returns -1 and writes nothing; the list is freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, which
        // stays valid until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() || !up {
            continue;
        }
        // SAFETY: ifa_addr is non-null and points at a sockaddr whose family
        // field is readable for every address family.
        let family = unsafe { (*ifa.ifa_addr).sa_family };
        if i32::from(family) != libc::AF_INET {
            continue;
        }
        // SAFETY: the family is AF_INET, so the address is a sockaddr_in.
        let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
        // SAFETY: ifa_name is a non-null NUL-terminated string in the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        out.push(Iface {
            name: name.to_string_lossy().into_owned(),
            addr: Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
            loopback: ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0,
        });
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

/// The address to bind when none is configured: the first non-loopback
/// IPv4 address, else 127.0.0.1.
pub(crate) fn default_addr(ifs: &[Iface]) -> IpAddr {
    ifs.iter()
        .find(|i| !i.loopback)
        .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |i| IpAddr::V4(i.addr))
}

/// The MTU of an interface, from sysfs.
pub(crate) fn iface_mtu(name: &str) -> Option<usize> {
    if name.contains('/') || name.starts_with('.') {
        return None;
    }
    std::fs::read_to_string(format!("/sys/class/net/{name}/mtu"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// MTU of the interface holding `addr` (loopback's for 127/8), or 1500.
pub(crate) fn mtu_of(ifs: &[Iface], addr: IpAddr) -> usize {
    let name = if addr.is_loopback() {
        ifs.iter().find(|i| i.loopback).map(|i| i.name.as_str())
    } else {
        ifs.iter()
            .find(|i| IpAddr::V4(i.addr) == addr)
            .map(|i| i.name.as_str())
    };
    name.and_then(iface_mtu).unwrap_or(1500)
}

/// Whether `addr` belongs to this host (traffic to it stays on loopback).
pub(crate) fn is_local(ifs: &[Iface], addr: IpAddr) -> bool {
    addr.is_loopback() || ifs.iter().any(|i| IpAddr::V4(i.addr) == addr)
}

/// The largest UDP payload for an IP MTU.
pub(crate) fn payload_for_mtu(mtu: usize) -> usize {
    mtu.saturating_sub(IP_UDP_HEADERS).clamp(512, MAX_PAYLOAD)
}

fn force_buf(s: &Socket, opt: libc::c_int, size: usize) -> bool {
    let v = libc::c_int::try_from(size).unwrap_or(libc::c_int::MAX);
    // SAFETY: setsockopt reads exactly size_of::<c_int>() bytes from &v,
    // which lives across the call; the fd is open (owned by `s`).
    let r = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(s),
            libc::SOL_SOCKET,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    r == 0
}

/// A non-blocking UDP socket bound to `ip` (port chosen by the kernel), with
/// buffers as large as we may get. Returns the socket and its receive
/// buffer size as the kernel reports it.
pub(crate) fn bind(ip: IpAddr) -> Result<(std::net::UdpSocket, usize)> {
    let ctx = |what: &str, e: std::io::Error| {
        Error::Config(format!(
            "udp: {what} {ip}: {e}; set BTL_UDP_ADDR to an address of this host"
        ))
    };
    let s = Socket::new(
        Domain::for_address(SocketAddr::new(ip, 0)),
        Type::DGRAM,
        Some(Protocol::UDP),
    )
    .map_err(|e| ctx("cannot create a socket for", e))?;
    // Root may exceed rmem_max/wmem_max; others get what the sysctl allows.
    if !force_buf(&s, libc::SO_RCVBUFFORCE, WANT_BUF) {
        let _ = s.set_recv_buffer_size(WANT_BUF);
    }
    if !force_buf(&s, libc::SO_SNDBUFFORCE, WANT_BUF) {
        let _ = s.set_send_buffer_size(WANT_BUF);
    }
    s.set_nonblocking(true)
        .map_err(|e| ctx("cannot make non-blocking a socket on", e))?;
    s.bind(&SocketAddr::new(ip, 0).into())
        .map_err(|e| ctx("cannot bind", e))?;
    let rcv = s.recv_buffer_size().unwrap_or(212_992);
    Ok((s.into(), rcv))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_facts_are_sane() {
        let ifs = interfaces();
        let a = default_addr(&ifs);
        assert!(a.is_ipv4());
        assert!(is_local(&ifs, a));
        assert!(mtu_of(&ifs, IpAddr::V4(Ipv4Addr::LOCALHOST)) >= 576);
        assert_eq!(payload_for_mtu(65536), MAX_PAYLOAD);
        assert_eq!(payload_for_mtu(1500), 1472);
        let (s, rcv) = bind(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
        assert!(rcv > 0);
        assert_ne!(s.local_addr().unwrap().port(), 0);
    }
}

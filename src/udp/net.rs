//! Host facts the driver needs: which address to bind (IPv4 or IPv6), the
//! MTU of the path to a peer, and sockets with large buffers.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use socket2::{Domain, Protocol, Socket, Type};

use crate::{Error, Result};

/// Bytes of IPv4 and UDP headers in front of a UDP payload (20 + 8).
pub(crate) const IP4_UDP_HEADERS: usize = 28;
/// Bytes of IPv6 and UDP headers in front of a UDP payload (40 + 8; we send
/// no extension headers).
pub(crate) const IP6_UDP_HEADERS: usize = 48;
/// Largest UDP payload we send, for both families: the IPv4 limit (IPv6
/// would allow 65527 without jumbograms; one cap keeps the protocol's
/// limit, `proto::Config::max_datagram`, the same everywhere).
pub(crate) const MAX_PAYLOAD: usize = 65_507;
/// Socket buffer size we ask for (forced past `rmem_max` when root).
const WANT_BUF: usize = 8 << 20;

/// One address of an interface that is up.
#[derive(Debug, Clone)]
pub(crate) struct Iface {
    pub(crate) name: String,
    pub(crate) addr: IpAddr,
    pub(crate) loopback: bool,
}

/// Whether `a` is an IPv6 link-local unicast address (fe80::/10).
pub(crate) fn is_link_local_v6(a: &Ipv6Addr) -> bool {
    a.segments()[0] & 0xffc0 == 0xfe80
}

/// Why `ip` cannot be a udp address of a job, if it cannot: what the
/// driver binds and what it accepts from a peer.
///
/// * Unspecified, multicast and broadcast addresses name no one host.
/// * IPv6 link-local addresses (fe80::/10) are only usable with a scope id
///   (the index of the interface on *this* host); the address exchange
///   carries bare addresses, and a peer's scope id would mean nothing here.
/// * IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`): our IPv6 sockets are
///   `IPV6_V6ONLY`, so they can neither bind nor reach one. Configured
///   ones are turned into plain IPv4 first ([`IpAddr::to_canonical`]); a
///   peer publishing one is refused, so its mapped form never enters the
///   peer table next to (or instead of) a plain IPv4 peer.
pub(crate) fn unusable(ip: IpAddr) -> Option<&'static str> {
    match ip {
        _ if ip.is_unspecified() => Some("it is unspecified"),
        _ if ip.is_multicast() => Some("it is a multicast address"),
        IpAddr::V4(a) if a.is_broadcast() => Some("it is the broadcast address"),
        IpAddr::V6(a) if is_link_local_v6(&a) => Some(
            "IPv6 link-local addresses (fe80::/10) need a scope id, which the address exchange does not carry; use a global or unique-local (fd00::/8) address",
        ),
        IpAddr::V6(a) if a.to_ipv4_mapped().is_some() => {
            Some("it is an IPv4-mapped IPv6 address (write the IPv4 address itself)")
        }
        _ => None,
    }
}

/// The name of an address's family, for messages.
pub(crate) fn family(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() {
        "IPv4"
    } else {
        "IPv6"
    }
}

/// The addresses (IPv4 and IPv6) of the interfaces that are up.
///
/// IPv6 link-local addresses (fe80::/10) are left out: they need a scope
/// id to bind and to reach (see [`unusable`]), so the driver never uses
/// one. Nothing is lost by leaving them out: the default address falls
/// back to 127.0.0.1 when no other address qualifies
/// ([`default_addr`]), and loopback's MTU is found through its other
/// addresses.
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
        let addr = match i32::from(family) {
            libc::AF_INET => {
                // SAFETY: the family is AF_INET, so the address is a
                // sockaddr_in (getifaddrs allocates the full structure).
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                // SAFETY: the family is AF_INET6, so the address is a
                // sockaddr_in6 (getifaddrs allocates the full structure).
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                let a = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                if is_link_local_v6(&a) {
                    continue;
                }
                IpAddr::V6(a)
            }
            _ => continue,
        };
        // SAFETY: ifa_name is a non-null NUL-terminated string in the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        out.push(Iface {
            name: name.to_string_lossy().into_owned(),
            addr,
            loopback: ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0,
        });
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

/// The address to bind when none is configured: the first non-loopback
/// IPv4 address; else the first non-loopback IPv6 address (global or
/// unique-local: link-local ones are never listed); else 127.0.0.1.
///
/// IPv4 comes first so that a job whose hosts all have IPv4 (the common
/// case, and what this default always was) keeps using it even where some
/// hosts also have IPv6: every rank of a job must use one family (a mixed
/// job fails at open, naming both addresses). A host with no IPv4 besides
/// loopback gets its IPv6 address rather than 127.0.0.1, which would reach
/// no other host. Set `BTL_UDP_ADDR` to choose.
pub(crate) fn default_addr(ifs: &[Iface]) -> IpAddr {
    let usable = |i: &&Iface| !i.loopback && unusable(i.addr).is_none();
    ifs.iter()
        .filter(usable)
        .find(|i| i.addr.is_ipv4())
        .or_else(|| ifs.iter().filter(usable).find(|i| i.addr.is_ipv6()))
        .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |i| i.addr)
}

/// The MTU of an interface, asked of the kernel (`SIOCGIFMTU`) in this
/// process's network namespace. (Not from sysfs: `/sys/class/net` shows
/// the namespace sysfs was mounted in, which a process that entered
/// another namespace without remounting it, `unshare -n` say, does not
/// live in.)
pub(crate) fn iface_mtu(name: &str) -> Option<usize> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return None;
    }
    let sock = Socket::new(Domain::IPV4, Type::DGRAM, None)
        .or_else(|_| Socket::new(Domain::IPV6, Type::DGRAM, None))
        .ok()?;
    // SAFETY: all-zero bytes are a valid ifreq (a name and a plain union).
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: `req` is a live ifreq holding a NUL-terminated name (checked
    // shorter than IFNAMSIZ, zero-filled after it); SIOCGIFMTU reads the
    // name and writes the union's `ifru_mtu`, nothing else.
    let r = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&sock),
            libc::SIOCGIFMTU as _,
            &mut req,
        )
    };
    if r != 0 {
        return None;
    }
    // SAFETY: the ioctl succeeded, so it wrote `ifru_mtu` (an int; every
    // bit pattern is a valid int).
    let mtu = unsafe { req.ifr_ifru.ifru_mtu };
    usize::try_from(mtu).ok().filter(|&m| m > 0)
}

/// The MTU of the route from `from` to `to` (`IP_MTU`/`IPV6_MTU` of a
/// UDP socket bound to `from` and connected to `to`: the route's own MTU,
/// or a smaller one the kernel learned for the path), if the kernel says.
/// Nothing is sent. (Bound like the data socket, so source-based routing
/// picks the route our datagrams take.)
pub(crate) fn route_mtu(from: IpAddr, to: IpAddr) -> Option<usize> {
    let (domain, level, opt) = match to {
        IpAddr::V4(_) => (Domain::IPV4, libc::IPPROTO_IP, libc::IP_MTU),
        IpAddr::V6(_) => (Domain::IPV6, libc::IPPROTO_IPV6, libc::IPV6_MTU),
    };
    let sock = Socket::new(domain, Type::DGRAM, None).ok()?;
    sock.bind(&SocketAddr::new(from, 0).into()).ok()?;
    // (Connecting a UDP socket only picks the route.)
    sock.connect(&SocketAddr::new(to, 9).into()).ok()?;
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are live for the call and `len` says how many
    // bytes `v` holds; the kernel writes at most that.
    let r = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&sock),
            level,
            opt,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return None;
    }
    usize::try_from(v).ok().filter(|&m| m > 0)
}

/// MTU of the interface holding `addr` (loopback's for 127/8 and ::1), or
/// 1500.
pub(crate) fn mtu_of(ifs: &[Iface], addr: IpAddr) -> usize {
    let name = if addr.is_loopback() {
        ifs.iter().find(|i| i.loopback).map(|i| i.name.as_str())
    } else {
        ifs.iter().find(|i| i.addr == addr).map(|i| i.name.as_str())
    };
    name.and_then(iface_mtu).unwrap_or(1500)
}

/// Whether `addr` belongs to this host (traffic to it stays on loopback).
pub(crate) fn is_local(ifs: &[Iface], addr: IpAddr) -> bool {
    addr.is_loopback() || ifs.iter().any(|i| i.addr == addr)
}

/// Whether datagrams of `dgram` bytes fit whole in a path of `mtu` bytes
/// of `ip`'s family (`payload_for_mtu` never goes below 512, which a very
/// small route MTU does not carry).
pub(crate) fn fits(dgram: usize, mtu: usize, ip: IpAddr) -> bool {
    dgram + headers(ip) <= mtu
}

/// IP and UDP header bytes of a datagram of `ip`'s family.
fn headers(ip: IpAddr) -> usize {
    if ip.is_ipv4() {
        IP4_UDP_HEADERS
    } else {
        IP6_UDP_HEADERS
    }
}

/// The largest UDP payload for an IP MTU on a path of `ip`'s family: the
/// MTU less 28 bytes of headers over IPv4, 48 over IPv6.
pub(crate) fn payload_for_mtu(mtu: usize, ip: IpAddr) -> usize {
    let headers = headers(ip);
    mtu.saturating_sub(headers).clamp(512, MAX_PAYLOAD)
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
    if ip.is_ipv6() {
        // IPv6 only, whatever net.ipv6.bindv6only says: such a socket never
        // sees IPv4 traffic, so no IPv4-mapped source address
        // (::ffff:a.b.c.d) reaches the peer table, and a socket bound to
        // an IPv6 address behaves the same on every host. (Bound to a
        // concrete IPv6 address it would get no IPv4 traffic anyway; the
        // option makes that explicit and independent of the sysctl.)
        s.set_only_v6(true)
            .map_err(|e| ctx("cannot make IPv6-only a socket on", e))?;
    }
    s.bind(&SocketAddr::new(ip, 0).into())
        .map_err(|e| ctx("cannot bind", e))?;
    let rcv = s.recv_buffer_size().unwrap_or(212_992);
    Ok((s.into(), rcv))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_mtus_come_from_the_kernel() {
        let ifs = interfaces();
        let lo = ifs
            .iter()
            .find(|i| i.loopback)
            .expect("a loopback interface");
        let mtu = iface_mtu(&lo.name).expect("the loopback MTU");
        // In the namespace sysfs shows (the test's own), both agree.
        if let Ok(s) = std::fs::read_to_string(format!("/sys/class/net/{}/mtu", lo.name)) {
            assert_eq!(s.trim().parse::<usize>().unwrap(), mtu);
        }
        assert_eq!(iface_mtu("no-such-if0"), None);
        assert_eq!(iface_mtu(&"x".repeat(libc::IFNAMSIZ)), None);
        assert_eq!(iface_mtu(""), None);
        assert_eq!(iface_mtu("lo\0x"), None);
        // The route to a loopback address allows no more than loopback
        // (65535 for its 65536: an IP packet's limit).
        let lo4 = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let route = route_mtu(lo4, lo4).expect("the route's MTU");
        assert!(
            route <= mtu && route >= mtu.min(65_535),
            "{route} against {mtu}"
        );
    }

    #[test]
    fn host_facts_are_sane() {
        let ifs = interfaces();
        let a = default_addr(&ifs);
        assert!(is_local(&ifs, a));
        assert!(unusable(a).is_none());
        assert!(mtu_of(&ifs, IpAddr::V4(Ipv4Addr::LOCALHOST)) >= 576);
        let (s, rcv) = bind(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
        assert!(rcv > 0);
        assert_ne!(s.local_addr().unwrap().port(), 0);
        assert!(ifs
            .iter()
            .all(|i| !matches!(i.addr, IpAddr::V6(a) if is_link_local_v6(&a))));
    }

    #[test]
    fn payload_accounts_for_each_family_headers() {
        let v4 = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let v6 = IpAddr::V6(Ipv6Addr::LOCALHOST);
        assert_eq!(payload_for_mtu(1500, v4), 1472);
        assert_eq!(payload_for_mtu(1500, v6), 1452);
        assert_eq!(payload_for_mtu(1280, v6), 1232);
        assert_eq!(payload_for_mtu(9000, v6), 8952);
        // Loopback's 64 KiB: the IPv4 cap, and 64 KiB less 48 over IPv6.
        assert_eq!(payload_for_mtu(65536, v4), MAX_PAYLOAD);
        assert_eq!(payload_for_mtu(65536, v6), 65_488);
        assert_eq!(payload_for_mtu(100, v6), 512);
    }

    fn iface(name: &str, addr: &str, loopback: bool) -> Iface {
        Iface {
            name: name.into(),
            addr: addr.parse().unwrap(),
            loopback,
        }
    }

    #[test]
    fn default_prefers_ipv4_then_ipv6_then_localhost() {
        let lo4 = iface("lo", "127.0.0.1", true);
        let lo6 = iface("lo", "::1", true);
        let eth4 = iface("eth0", "192.0.2.7", false);
        let eth6 = iface("eth0", "fd00::7", false);
        let both = [lo6.clone(), lo4.clone(), eth6.clone(), eth4.clone()];
        assert_eq!(default_addr(&both), eth4.addr);
        let v6 = [lo6.clone(), lo4.clone(), eth6.clone()];
        assert_eq!(default_addr(&v6), eth6.addr);
        assert_eq!(default_addr(&[lo6, lo4]), IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert_eq!(default_addr(&[]), IpAddr::V4(Ipv4Addr::LOCALHOST));
    }

    #[test]
    fn ipv6_addresses_find_their_interface() {
        let ifs = [
            iface("lo", "127.0.0.1", true),
            iface("lo", "::1", true),
            iface("eth0", "fd00::7", false),
        ];
        assert!(is_local(&ifs, "::1".parse().unwrap()));
        assert!(is_local(&ifs, "fd00::7".parse().unwrap()));
        assert!(!is_local(&ifs, "fd00::8".parse().unwrap()));
        // Not on this host: the default 1500 (sysfs names are not read for
        // addresses that no interface holds).
        assert_eq!(mtu_of(&ifs, "2001:db8::1".parse().unwrap()), 1500);
        assert_eq!(
            mtu_of(&ifs, "::1".parse().unwrap()),
            mtu_of(&ifs, "127.0.0.1".parse().unwrap())
        );
    }

    #[test]
    fn unusable_addresses_say_why() {
        for bad in ["0.0.0.0", "::", "224.0.0.1", "ff02::1", "255.255.255.255"] {
            assert!(unusable(bad.parse().unwrap()).is_some(), "{bad}");
        }
        let ll = unusable("fe80::1".parse().unwrap()).unwrap();
        assert!(ll.contains("scope id"), "{ll}");
        assert!(unusable("febf::1".parse().unwrap()).is_some());
        let mapped = unusable("::ffff:127.0.0.1".parse().unwrap()).unwrap();
        assert!(mapped.contains("IPv4-mapped"), "{mapped}");
        for good in ["127.0.0.1", "::1", "fd00::2", "2001:db8::1", "fec0::1"] {
            assert_eq!(unusable(good.parse().unwrap()), None, "{good}");
        }
    }

    /// Whether this host can bind ::1 (IPv6 may be disabled).
    fn has_ipv6_loopback() -> bool {
        std::net::UdpSocket::bind("[::1]:0").is_ok()
    }

    #[test]
    fn ipv6_sockets_are_v6_only() {
        if !has_ipv6_loopback() {
            println!("skipped: cannot bind [::1]:0 (IPv6 disabled on this host?)");
            return;
        }
        let (s, rcv) = bind(IpAddr::V6(Ipv6Addr::LOCALHOST)).unwrap();
        assert!(rcv > 0);
        let a = s.local_addr().unwrap();
        assert_eq!(a.ip(), IpAddr::V6(Ipv6Addr::LOCALHOST));
        assert_ne!(a.port(), 0);
        let s2 = Socket::from(s);
        assert!(s2.only_v6().unwrap());
        // The mapped form cannot be bound by an IPv6-only socket: the
        // driver turns a configured one into plain IPv4 first.
        assert!(bind("::ffff:127.0.0.1".parse().unwrap()).is_err());
    }
}

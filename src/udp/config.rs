//! `udp`'s settings: the address, path MTU, window, timeouts, bundling and
//! segmentation offload. Read from `BTL_UDP_*` variables by
//! [`crate::Config`].

use std::time::Duration;

use crate::sys::env::{parse, switch};
use crate::{Error, Result};

/// Settings of the `udp` transport (`Config::udp`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdpConfig {
    /// The local address to bind and publish, IPv4 or IPv6 (`::1`, a
    /// global or unique-local address; not link-local, whose scope id the
    /// address exchange does not carry; an IPv4-mapped `::ffff:a.b.c.d`
    /// means `a.b.c.d`). Every rank that talks over udp must use the same
    /// family. Default: the first non-loopback IPv4 address of the host,
    /// else its first non-loopback IPv6 address, else 127.0.0.1.
    /// Env: `BTL_UDP_ADDR`.
    pub addr: Option<std::net::IpAddr>,
    /// The IP MTU to assume on every path (datagrams are this minus 28
    /// bytes of IPv4 and UDP headers, 48 over IPv6). Default: from the
    /// interfaces (65536 on loopback and to peers on this host, else the
    /// smaller of both sides' interface MTUs). Env: `BTL_UDP_MTU`.
    pub mtu: Option<usize>,
    /// The largest send/receive window, in datagrams (it is also limited
    /// by the receiver's socket buffer). Default 256, or as many as make
    /// 1 MiB when datagrams are smaller than 4 KiB (712 on a 1500-byte
    /// path). Env: `BTL_UDP_WINDOW`.
    pub window: Option<u32>,
    /// A peer not heard from (data, ACKs or keepalives) for this long is
    /// lost and everything pending on it fails. Env:
    /// `BTL_UDP_PEER_TIMEOUT_MS`.
    pub peer_timeout: Duration,
    /// A peer that still answers keepalives but acknowledges none of our
    /// outstanding data for this long is lost too (a path that drops large
    /// datagrams, or a receiver that stopped reading for that long).
    /// Env: `BTL_UDP_STALL_TIMEOUT_MS`.
    pub stall_timeout: Duration,
    /// Gather small messages into bundles while the path is busy, and
    /// put/get requests started together into one (on by default). Off,
    /// every message leaves as soon as the window allows, like
    /// `TCP_NODELAY`. Env: `BTL_UDP_BUNDLE` (`1`/`on`, `0`/`off`).
    pub bundle: bool,
    /// Send runs of datagrams of one size as GSO packets and accept
    /// GRO-coalesced receives on the data socket, where the kernel offers
    /// them (on by default; they matter on paths with an MTU below 64 KiB,
    /// such as Ethernet). Env: `BTL_UDP_GSO` (`1`/`on`, `0`/`off`).
    pub gso: bool,
    /// What closes every datagram. [`Guard::Crc`](super::proto::Guard::Crc)
    /// (the default): a CRC32C, which catches corruption but not forgery: a
    /// host on the path, or a local user with raw-socket rights, who reads
    /// the job id and sequence numbers off the wire can send datagrams the
    /// receiver takes as the peer's. [`Guard::Mac`](super::proto::Guard::Mac):
    /// an AES-128-GCM tag under a key per direction of each pair, derived
    /// from the job key, with a nonce counter, so that a datagram no rank
    /// of the job sealed is dropped and counted
    /// ([`UdpStats::bad_trailers`](crate::UdpStats::bad_trailers)), whoever
    /// sent it and whatever it says. It costs about a third of the
    /// bandwidth of 1 MiB messages on loopback, where the CPU is the
    /// bottleneck (see the benchmarks page), which is why it is not the
    /// default: turn it on for networks you do not trust. Every rank must
    /// use the same. Env: `BTL_UDP_AUTH` (`crc`, `mac`).
    pub auth: super::proto::Guard,
}

impl Default for UdpConfig {
    fn default() -> Self {
        UdpConfig {
            addr: None,
            mtu: None,
            window: None,
            peer_timeout: Duration::from_secs(5),
            stall_timeout: Duration::from_secs(60),
            bundle: true,
            gso: true,
            auth: super::proto::Guard::Crc,
        }
    }
}

impl UdpConfig {
    /// Override from the `BTL_UDP_*` variables `get` finds.
    pub(crate) fn read(&mut self, get: &dyn Fn(&str) -> Option<String>) -> Result<()> {
        let num = |k: &str| -> Result<Option<u64>> { get(k).map(|v| parse(k, &v)).transpose() };
        if let Some(v) = num("BTL_UDP_PEER_TIMEOUT_MS")? {
            self.peer_timeout = Duration::from_millis(v.max(1));
        }
        if let Some(v) = num("BTL_UDP_STALL_TIMEOUT_MS")? {
            self.stall_timeout = Duration::from_millis(v.max(1));
        }
        if let Some(v) = get("BTL_UDP_BUNDLE") {
            self.bundle = switch(&v).ok_or_else(|| {
                Error::Config(format!(
                    "BTL_UDP_BUNDLE={v:?}: use 1 (gather small messages, the default) or 0 (send each at once)"
                ))
            })?;
        }
        if let Some(v) = get("BTL_UDP_GSO") {
            self.gso = switch(&v).ok_or_else(|| {
                Error::Config(format!(
                    "BTL_UDP_GSO={v:?}: use 1 (segmentation offload where the kernel has it, the default) or 0 (datagram by datagram)"
                ))
            })?;
        }
        if let Some(v) = get("BTL_UDP_AUTH") {
            self.auth = match v.trim().to_ascii_lowercase().as_str() {
                "mac" => super::proto::Guard::Mac,
                "crc" => super::proto::Guard::Crc,
                _ => {
                    return Err(Error::Config(format!(
                        "BTL_UDP_AUTH={v:?}: use crc (a checksum only, the default, for a trusted network) or mac (authenticate every datagram)"
                    )))
                }
            };
        }
        if let Some(v) = get("BTL_UDP_ADDR") {
            let a: std::net::IpAddr = v
                .trim()
                .parse()
                .map_err(|_| Error::Config(format!("BTL_UDP_ADDR={v:?} is not an IP address")))?;
            // ::ffff:a.b.c.d is a.b.c.d (IPv6 sockets here are IPv6-only).
            self.addr = Some(a.to_canonical());
        }
        if let Some(v) = num("BTL_UDP_WINDOW")? {
            self.window = Some(v.clamp(4, 1 << 16) as u32);
        }
        if let Some(v) = num("BTL_UDP_MTU")? {
            self.mtu = Some(v as usize);
        }
        Ok(())
    }

    /// Check that the settings make sense.
    pub(crate) fn validate(&self) -> Result<()> {
        if let Some(m) = self.mtu {
            if !(576..=65_535 + 1).contains(&m) {
                return Err(Error::Config(format!(
                    "udp MTU {m} must be between 576 and 65536"
                )));
            }
        }
        if let Some(a) = self.addr {
            if let Some(why) = super::unusable_addr(a.to_canonical()) {
                return Err(Error::Config(format!(
                    "udp address {a} cannot be used: {why}; it must be an IPv4 or IPv6 address of this host"
                )));
            }
        }
        Ok(())
    }
}

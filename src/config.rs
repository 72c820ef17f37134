//! Tunables, with defaults chosen from measurements on the dev machines.
//! Every field can also be set through a `BTL_*` environment variable (see
//! [`Config::from_env`]).

use std::time::Duration;

use crate::{Error, Result};

/// How a transport's progress task waits for work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProgressMode {
    /// Poll without ever sleeping: lowest latency, one core per process busy.
    /// For benchmarks and dedicated nodes.
    BusyPoll,
    /// Poll while traffic flows, then park on a doorbell after
    /// [`Config::spin`] without work. Near busy-poll latency when hot, ~0% CPU
    /// when idle. The default.
    #[default]
    Adaptive,
    /// Always park between events: lowest CPU, highest latency.
    Interrupt,
}

impl std::str::FromStr for ProgressMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "busy" | "busypoll" | "busy-poll" | "poll" => Ok(ProgressMode::BusyPoll),
            "adaptive" => Ok(ProgressMode::Adaptive),
            "interrupt" | "park" => Ok(ProgressMode::Interrupt),
            other => Err(Error::Config(format!(
                "unknown progress mode {other:?}: use busy, adaptive or interrupt"
            ))),
        }
    }
}

/// How large copies (from 32 KiB to below half the core's L2 cache: puts
/// and gets into a peer's mapping, copy-out of large messages) are done;
/// smaller and larger ones always use `memmove`. The choice is per
/// process: the first fabric opened makes it, later ones keep it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CopyMode {
    /// The vector loop where the CPU has AVX2, else `memmove`. The
    /// default: `memmove`'s `rep movsb` lowered the core's clock after ~4 ms
    /// of copying on the Xeons here, the loop never did (see
    /// ARCHITECTURE.md, "Bulk copies").
    #[default]
    Auto,
    /// The C library's `memmove`.
    Libc,
    /// async-btl's own vector loop (AVX2; where the CPU lacks it, `Libc`).
    Vector,
}

impl std::str::FromStr for CopyMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(CopyMode::Auto),
            "libc" | "memcpy" => Ok(CopyMode::Libc),
            "vector" | "avx2" => Ok(CopyMode::Vector),
            other => Err(Error::Config(format!(
                "unknown copy routine {other:?}: use auto, libc or vector"
            ))),
        }
    }
}

/// Settings of a [`Fabric`](crate::Fabric).
#[derive(Debug, Clone)]
pub struct Config {
    /// Progress policy for every transport. Env: `BTL_PROGRESS`.
    pub progress: ProgressMode,
    /// How long an `Adaptive` progress task keeps polling after its last work
    /// before it parks. Env: `BTL_SPIN_US`.
    pub spin: Duration,
    /// How often peers are checked for liveness. Env: `BTL_HEARTBEAT_MS`.
    pub heartbeat: Duration,
    /// The routine for copies from 32 KiB to below half the L2 (see
    /// [`CopyMode`]).
    /// Env: `BTL_COPY` (`auto`, `libc`, `vector`).
    pub copy: CopyMode,
    /// Shared memory: size of an eager fragment, header included; a
    /// message that fits in one (and is too big for the fast box) takes
    /// one. 16 KiB, so that every message below `sm_cma_min` does: with
    /// 4 KiB ones, a 4 KiB message (24 bytes too many) and an 8 KiB one
    /// took a max fragment, and their half round trips were 1.14x and 1.13x
    /// what they are now on session 12's Xeon; streaming did not change.
    /// Env: `BTL_SM_EAGER`.
    pub sm_eager_size: usize,
    /// Shared memory: number of eager fragments per process. Env: `BTL_SM_EAGER_COUNT`.
    pub sm_eager_count: usize,
    /// Shared memory: size of a max fragment, header included. Env: `BTL_SM_MAX`.
    pub sm_max_size: usize,
    /// Shared memory: number of max fragments per process. Env: `BTL_SM_MAX_COUNT`.
    pub sm_max_count: usize,
    /// Shared memory: sends, and put/get to or from a registered
    /// (non-shared) buffer, of at least this many bytes use a single kernel
    /// copy (CMA; a rendezvous for sends) instead of fragments, where ptrace
    /// rules allow. 16 KiB: from there single copy beat two copies through
    /// fragments in latency here (16 KiB ping-pong 4.6 → 3.2 µs). Env:
    /// `BTL_SM_CMA_MIN` (a huge value turns CMA off).
    pub sm_cma_min: usize,
    /// Shared memory: rendezvous sends of at least this many bytes are
    /// copied by both processes at once (the receiver reads the head, the
    /// sender writes the tail into the receiver's buffer; see ARCHITECTURE),
    /// so two cores run the kernel's copy instead of one. A sender that does
    /// not take its part in time leaves it to the receiver. 64 KiB: there
    /// split copy made streaming 1.23-1.33x and the half round trip
    /// 0.89-0.90x of a one-core copy on session 12's Xeon, while at 32 KiB
    /// it lost (streaming 0.86x). Env: `BTL_SM_SPLIT_MIN` (a huge value
    /// turns it off).
    pub sm_split_min: usize,
    /// Bytes of received but not yet consumed messages kept per tag before the
    /// transports stop reading from that sender (backpressure). Env: `BTL_RECV_BUDGET`.
    pub recv_budget: usize,
    /// Bytes of received but not yet consumed messages kept for all tags
    /// together, so a peer spreading messages over many tags cannot grow our
    /// memory without bound (beyond it, reading stops until the program
    /// consumes some; a program that never reads the full tags would then
    /// wait). Env: `BTL_RECV_TOTAL_BUDGET`.
    pub recv_total_budget: usize,
    /// Limit on the address exchange at start-up. Env: `BTL_BOOT_TIMEOUT_MS`.
    pub boot_timeout: Duration,
    /// Limit on `Fabric::close` waiting for peers. Env: `BTL_CLOSE_TIMEOUT_MS`.
    pub close_timeout: Duration,
    /// UDP: the local address to bind and publish, IPv4 or IPv6 (`::1`, a
    /// global or unique-local address; not link-local, whose scope id the
    /// address exchange does not carry; an IPv4-mapped `::ffff:a.b.c.d`
    /// means `a.b.c.d`). Every rank that talks over udp must use the same
    /// family. Default: the first non-loopback IPv4 address of the host,
    /// else its first non-loopback IPv6 address, else 127.0.0.1.
    /// Env: `BTL_UDP_ADDR`.
    pub udp_addr: Option<std::net::IpAddr>,
    /// UDP: the IP MTU to assume on every path (datagrams are this minus 28
    /// bytes of IPv4 and UDP headers, 48 over IPv6). Default: from the interfaces (65536 on
    /// loopback and to peers on this host, else the smaller of both sides'
    /// interface MTUs). Env: `BTL_UDP_MTU`.
    pub udp_mtu: Option<usize>,
    /// UDP: the largest send/receive window, in datagrams (it is also
    /// limited by the receiver's socket buffer). Default 256, or as many
    /// as make 1 MiB when datagrams are smaller than 4 KiB (712 on a
    /// 1500-byte path). Env: `BTL_UDP_WINDOW`.
    pub udp_window: Option<u32>,
    /// UDP: a peer not heard from (data, ACKs or keepalives) for this long is
    /// lost and everything pending on it fails. Env: `BTL_UDP_PEER_TIMEOUT_MS`.
    pub udp_peer_timeout: Duration,
    /// UDP: a peer that still answers keepalives but acknowledges none of
    /// our outstanding data for this long is lost too (a path that drops
    /// large datagrams, or a receiver that stopped reading for that long).
    /// Env: `BTL_UDP_STALL_TIMEOUT_MS`.
    pub udp_stall_timeout: Duration,
    /// UDP: gather small messages into bundles while the path is busy, and
    /// put/get requests started together into one (on by default). Off,
    /// every message leaves as soon as the window allows, like
    /// `TCP_NODELAY`. Env: `BTL_UDP_BUNDLE` (`1`/`on`, `0`/`off`).
    pub udp_bundle: bool,
    /// UDP: send runs of datagrams of one size as GSO packets and accept
    /// GRO-coalesced receives on the data socket, where the kernel offers
    /// them (on by default; they matter on paths with an MTU below 64 KiB,
    /// such as Ethernet). Env: `BTL_UDP_GSO` (`1`/`on`, `0`/`off`).
    pub udp_gso: bool,
    /// Transports allowed, in preference order (`BTL_TRANSPORTS=sm,udp`, like
    /// `UCX_TLS`). Empty means all.
    pub transports: Vec<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            progress: ProgressMode::Adaptive,
            spin: Duration::from_micros(200),
            heartbeat: Duration::from_millis(100),
            copy: CopyMode::Auto,
            sm_eager_size: 16 * 1024,
            sm_eager_count: 64,
            sm_max_size: 128 * 1024,
            sm_max_count: 16,
            sm_cma_min: 16 * 1024,
            sm_split_min: 64 * 1024,
            recv_budget: 32 << 20,
            recv_total_budget: 1 << 30,
            boot_timeout: Duration::from_secs(30),
            close_timeout: Duration::from_secs(10),
            udp_addr: None,
            udp_mtu: None,
            udp_window: None,
            udp_peer_timeout: Duration::from_secs(5),
            udp_stall_timeout: Duration::from_secs(60),
            udp_bundle: true,
            udp_gso: true,
            transports: Vec::new(),
        }
    }
}

/// An on/off setting: `1`/`on`/`yes`/`true` or `0`/`off`/`no`/`false`.
fn switch(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "on" | "yes" | "true" => Some(true),
        "0" | "off" | "no" | "false" => Some(false),
        _ => None,
    }
}

fn parse<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
    v.trim()
        .parse()
        .map_err(|_| Error::Config(format!("{name}={v:?} is not a valid number")))
}

impl Config {
    /// Defaults overridden by any `BTL_*` variables that are set.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`Config::from_env`], reading variables through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut c = Config::default();
        if let Some(v) = get("BTL_PROGRESS") {
            c.progress = v.parse()?;
        }
        if let Some(v) = get("BTL_COPY") {
            c.copy = v.parse()?;
        }
        let us = |k: &str| -> Result<Option<u64>> { get(k).map(|v| parse(k, &v)).transpose() };
        if let Some(v) = us("BTL_SPIN_US")? {
            c.spin = Duration::from_micros(v);
        }
        if let Some(v) = us("BTL_HEARTBEAT_MS")? {
            c.heartbeat = Duration::from_millis(v.max(1));
        }
        if let Some(v) = us("BTL_BOOT_TIMEOUT_MS")? {
            c.boot_timeout = Duration::from_millis(v);
        }
        if let Some(v) = us("BTL_CLOSE_TIMEOUT_MS")? {
            c.close_timeout = Duration::from_millis(v);
        }
        if let Some(v) = us("BTL_UDP_PEER_TIMEOUT_MS")? {
            c.udp_peer_timeout = Duration::from_millis(v.max(1));
        }
        if let Some(v) = us("BTL_UDP_STALL_TIMEOUT_MS")? {
            c.udp_stall_timeout = Duration::from_millis(v.max(1));
        }
        if let Some(v) = get("BTL_UDP_BUNDLE") {
            c.udp_bundle = switch(&v).ok_or_else(|| {
                Error::Config(format!(
                    "BTL_UDP_BUNDLE={v:?}: use 1 (gather small messages, the default) or 0 (send each at once)"
                ))
            })?;
        }
        if let Some(v) = get("BTL_UDP_GSO") {
            c.udp_gso = switch(&v).ok_or_else(|| {
                Error::Config(format!(
                    "BTL_UDP_GSO={v:?}: use 1 (segmentation offload where the kernel has it, the default) or 0 (datagram by datagram)"
                ))
            })?;
        }
        if let Some(v) = get("BTL_UDP_ADDR") {
            let a: std::net::IpAddr = v
                .trim()
                .parse()
                .map_err(|_| Error::Config(format!("BTL_UDP_ADDR={v:?} is not an IP address")))?;
            // ::ffff:a.b.c.d is a.b.c.d (IPv6 sockets here are IPv6-only).
            c.udp_addr = Some(a.to_canonical());
        }
        if let Some(v) = us("BTL_UDP_WINDOW")? {
            c.udp_window = Some(v.clamp(4, 1 << 16) as u32);
        }
        if let Some(v) = us("BTL_UDP_MTU")? {
            c.udp_mtu = Some(v as usize);
        }
        for (k, f) in [
            ("BTL_SM_EAGER", &mut c.sm_eager_size),
            ("BTL_SM_EAGER_COUNT", &mut c.sm_eager_count),
            ("BTL_SM_MAX", &mut c.sm_max_size),
            ("BTL_SM_MAX_COUNT", &mut c.sm_max_count),
            ("BTL_RECV_BUDGET", &mut c.recv_budget),
            ("BTL_RECV_TOTAL_BUDGET", &mut c.recv_total_budget),
            ("BTL_SM_CMA_MIN", &mut c.sm_cma_min),
            ("BTL_SM_SPLIT_MIN", &mut c.sm_split_min),
        ] {
            if let Some(v) = get(k) {
                *f = parse(k, &v)?;
            }
        }
        if let Some(v) = get("BTL_TRANSPORTS") {
            c.transports = Self::parse_transports(&v);
        }
        c.validate()?;
        Ok(c)
    }

    /// Split a transport list like `BTL_TRANSPORTS` (`"sm, UDP"` →
    /// `["sm", "udp"]`).
    pub fn parse_transports(list: &str) -> Vec<String> {
        list.split(',')
            .map(|s| s.trim().to_ascii_lowercase())
            .filter(|s| !s.is_empty())
            .collect()
    }

    /// Check that the settings make sense together.
    pub fn validate(&self) -> Result<()> {
        let frag = crate::sm::FRAG_HEADER;
        if self.sm_eager_size < frag + 8 || self.sm_eager_size % 8 != 0 {
            return Err(Error::Config(format!(
                "sm eager fragment size {} must be a multiple of 8 and at least {}",
                self.sm_eager_size,
                frag + 8
            )));
        }
        if self.sm_max_size < self.sm_eager_size || self.sm_max_size % 8 != 0 {
            return Err(Error::Config(format!(
                "sm max fragment size {} must be a multiple of 8 and at least the eager size {}",
                self.sm_max_size, self.sm_eager_size
            )));
        }
        if self.sm_eager_count == 0 || self.sm_max_count == 0 {
            return Err(Error::Config(
                "sm fragment counts must be at least 1".into(),
            ));
        }
        if self.sm_max_size > u32::MAX as usize / 2 {
            return Err(Error::Config("sm max fragment size is too large".into()));
        }
        if let Some(m) = self.udp_mtu {
            if !(576..=65_535 + 1).contains(&m) {
                return Err(Error::Config(format!(
                    "udp MTU {m} must be between 576 and 65536"
                )));
            }
        }
        if let Some(a) = self.udp_addr {
            if let Some(why) = crate::udp::unusable_addr(a.to_canonical()) {
                return Err(Error::Config(format!(
                    "udp address {a} cannot be used: {why}; it must be an IPv4 or IPv6 address of this host"
                )));
            }
        }
        for t in &self.transports {
            if crate::transport::registry::find(t).is_none() {
                return Err(Error::Config(format!(
                    "BTL_TRANSPORTS names unknown transport {t:?}; known: {:?}",
                    crate::transport::registry::names()
                )));
            }
        }
        Ok(())
    }

    /// Whether transport `name` may be used.
    pub fn allows(&self, name: &str) -> bool {
        self.transports.is_empty() || self.transports.iter().any(|t| t == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_udp_addr(v: &str) -> Result<Config> {
        Config::from_lookup(|k| (k == "BTL_UDP_ADDR").then(|| v.to_string()))
    }

    #[test]
    fn udp_addr_takes_ipv4_and_ipv6() {
        for (v, want) in [
            ("127.0.0.1", "127.0.0.1"),
            ("::1", "::1"),
            (" fd00::2 ", "fd00::2"),
            ("2001:db8::1", "2001:db8::1"),
            ("::ffff:192.0.2.1", "192.0.2.1"),
        ] {
            let c = with_udp_addr(v).unwrap();
            assert_eq!(c.udp_addr, Some(want.parse().unwrap()), "{v}");
        }
        for bad in [
            "fe80::1", "::", "0.0.0.0", "ff02::1", "[::1]", "::1%lo", "host",
        ] {
            let e = with_udp_addr(bad).unwrap_err();
            assert!(matches!(e, Error::Config(_)), "{bad}: {e}");
        }
        let e = with_udp_addr("fe80::1").unwrap_err().to_string();
        assert!(e.contains("scope id"), "{e}");
    }

    #[test]
    fn udp_bundle_switch() {
        let with =
            |v: &str| Config::from_lookup(|k| (k == "BTL_UDP_BUNDLE").then(|| v.to_string()));
        assert!(Config::default().udp_bundle);
        for (v, want) in [("1", true), ("on", true), ("0", false), (" OFF ", false)] {
            assert_eq!(with(v).unwrap().udp_bundle, want, "{v}");
        }
        let e = with("maybe").unwrap_err().to_string();
        assert!(e.contains("BTL_UDP_BUNDLE"), "{e}");
    }

    #[test]
    fn udp_gso_switch() {
        let with = |v: &str| Config::from_lookup(|k| (k == "BTL_UDP_GSO").then(|| v.to_string()));
        assert!(Config::default().udp_gso);
        for (v, want) in [("1", true), ("yes", true), ("0", false), ("false", false)] {
            assert_eq!(with(v).unwrap().udp_gso, want, "{v}");
        }
        let e = with("2").unwrap_err().to_string();
        assert!(e.contains("BTL_UDP_GSO"), "{e}");
    }

    #[test]
    fn copy_mode_names() {
        let with = |v: &str| Config::from_lookup(|k| (k == "BTL_COPY").then(|| v.to_string()));
        assert_eq!(Config::default().copy, CopyMode::Auto);
        for (v, want) in [
            ("auto", CopyMode::Auto),
            ("LIBC", CopyMode::Libc),
            ("memcpy", CopyMode::Libc),
            ("vector", CopyMode::Vector),
            (" avx2 ", CopyMode::Vector),
        ] {
            assert_eq!(with(v).unwrap().copy, want, "{v}");
        }
        let e = with("fast").unwrap_err().to_string();
        assert!(e.contains("auto, libc or vector"), "{e}");
    }
}

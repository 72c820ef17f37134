//! The `udp` transport: the usNIC reliability protocol carried over plain
//! UDP — the multi-node path, and a loopback one when forced
//! (`BTL_TRANSPORTS=udp`).
//!
//! [`proto`] is the sans-IO protocol engine (no sockets, no clock); the
//! driver around it is small:
//!
//! - [`net`](self) picks the address (`BTL_UDP_ADDR`, IPv4 or IPv6; else
//!   the first non-loopback IPv4, else the first non-loopback, non
//!   link-local IPv6, else 127.0.0.1) and binds two sockets, a data one
//!   and a priority one (ACKs and tiny messages), as in the seed; IPv6
//!   sockets are `IPV6_V6ONLY`. Both ports, a random 64-bit ISN, the
//!   interface MTU and the receive buffer size are published in the
//!   address exchange. All ranks that talk over udp must use one family:
//!   a job that mixes them fails at open, naming both addresses
//!   (`check_families`).
//! - Per peer, the datagram size comes from the path MTU (loopback's 64 KiB
//!   to peers on this host, else the smaller interface MTU of both sides,
//!   or `BTL_UDP_MTU`) less the IP and UDP headers (28 bytes over IPv4, 48
//!   over IPv6), and the send window from the *peer's* socket buffer, so a
//!   window of datagrams fits where they land.
//! - `frame` puts `(kind, tag)` in front of the data (copied into a pooled
//!   buffer); messages of 64 KiB or more travel as a head plus the user's
//!   `Bytes` itself (no copy).
//! - Sends go out from the caller's task (no wake-up of the progress task
//!   on the latency path); what the protocol's send budget refuses waits in
//!   an ordered per-peer queue whose `Completion` fires when the protocol
//!   takes it (local completion: held in retransmit storage).
//! - `io`: `recvmmsg`/`sendmmsg` batches through tokio readiness; while
//!   hot, the socket that delivered last is asked directly (`recvfrom`
//!   when it was empty last time), so a datagram is found as soon as it
//!   lands. A datagram goes out in parts (header, a slice of the user's
//!   `Bytes`, checksum) with `sendmsg`, or `sendmmsg` for several: the
//!   payload is never copied into a transmit buffer.
//! - `rx`: filtering (job id, source address and ranks: anything else is
//!   counted in `Stats::foreign_datagrams`), receive-side backpressure.
//! - Liveness: every peer hears from us at least every quarter of
//!   `BTL_UDP_PEER_TIMEOUT_MS` (a keepalive ACK when we have nothing else
//!   to send); a peer silent for the whole timeout is lost and everything
//!   pending on it fails. The protocol's own no-progress timer is set to
//!   `BTL_UDP_STALL_TIMEOUT_MS`, a long guard against a path that passes
//!   keepalives but not data (a receiver that merely stopped reading must
//!   not look dead).
//! - Every 10 s a `tracing` debug line per peer prints the protocol's
//!   counters (usNIC-stats style).
//!
//! - On the data socket, runs of datagrams of one size leave as UDP GSO
//!   packets and receives take GRO-joined datagrams (`offload`), where the
//!   kernel has them: on a 1500-byte path that is most of the per-datagram
//!   cost of the stack saved. `BTL_UDP_GSO=0` turns them off.
//!
//! Not done yet: IPv6 link-local addresses (they need scope ids, which the exchange does
//! not carry; see `net::unusable`).

pub(crate) mod config;
pub(crate) mod frame;
mod io;
mod link;
mod net;
mod offload;
pub(crate) mod peer;
pub mod proto;
mod rx;
pub(crate) mod stats;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::core::fabric::Core;
use crate::sys::sync::lock;
use crate::transport::registry::{Entry, Job};
use crate::transport::{Link, Peer as PeerInfo, Published, Transport};
use crate::{Error, Rank, Result};
use peer::{Peer, PeerState, Sockets};
use rx::RxState;

/// What a process publishes about its `udp` transport.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct UdpAddr {
    /// IPv4 or IPv6 (never IPv4-mapped: see `net::unusable`).
    pub(crate) ip: IpAddr,
    pub(crate) data_port: u16,
    pub(crate) prio_port: u16,
    /// Random initial sequence number (mixed with the peer's rank per pair).
    pub(crate) isn: u64,
    /// MTU of the interface holding `ip`.
    pub(crate) mtu: u32,
    /// Receive buffer of our sockets as the kernel reports it.
    pub(crate) rcvbuf: u32,
    /// What guards our datagrams (`Guard::name`): every rank must agree.
    pub(crate) auth: String,
    /// Random per process: mixed into the keys of every pair it is in, so
    /// that each incarnation of a pair has keys of its own.
    pub(crate) salt: [u8; 16],
}

/// Bytes the default window lets be in flight at least (see
/// `proto_config`).
const WINDOW_BYTES: usize = 1 << 20;

/// How often the per-peer statistics line is logged.
const REPORT_EVERY: Duration = Duration::from_secs(10);

/// The `udp` transport of one process.
pub(crate) struct UdpTransport {
    pub(crate) core: Arc<Core>,
    /// Our settings (`Config::udp`, as the fabric opened with them).
    pub(crate) config: config::UdpConfig,
    pub(crate) io: Sockets,
    me: UdpAddr,
    ifs: Vec<net::Iface>,
    pub(crate) job: u64,
    peers: OnceLock<Vec<Option<Arc<Peer>>>>,
    pub(crate) by_addr: OnceLock<HashMap<SocketAddr, Rank>>,
    rx: Mutex<RxState>,
    keepalive: Duration,
    /// Wakes a parked progress task (a send made an earlier deadline).
    kick: Notify,
    armed: AtomicBool,
    /// Datagrams dropped before the protocol saw them (`UdpStats`).
    pub(crate) foreign: AtomicU64,
    /// When the parked task must wake, in ns since `epoch` (MAX: none).
    wake_at: AtomicU64,
    /// Some peer has datagrams the kernel refused: wait for writability.
    backlog: AtomicBool,
    /// A progress call delivered messages and left the service pass (timers,
    /// queues, transmissions) to the next call, so that the receiver gets
    /// its message first (see `progress`).
    service_owed: AtomicBool,
    epoch: Instant,
    last_report: Mutex<Instant>,
}

/// Store `next`, a deadline computed from a walk over the peers that began
/// when `wake_at` held `planned`, unless `wake_at` changed meanwhile (a
/// user send lowered it for a peer already walked past): then keep the
/// earlier of the two, so a concurrent lowering is never overwritten by a
/// later deadline (which would delay that timer).
fn publish_wake_at(wake_at: &AtomicU64, planned: u64, next: u64) {
    // AcqRel: pairs with the fetch_min in `after_send`.
    if wake_at
        .compare_exchange(planned, next, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        wake_at.fetch_min(next, Ordering::AcqRel);
    }
}

/// Large received messages are reassembled in the fabric's recycled
/// buffers (no page faults for every message).
struct Pool(Arc<crate::core::bufpool::BufPool>);

impl proto::Buffers for Pool {
    fn take(&self, len: usize) -> Vec<u8> {
        self.0.take(len)
    }

    fn freeze(&self, buf: Vec<u8>) -> bytes::Bytes {
        self.0.freeze(buf)
    }

    fn recycle(&self, buf: Vec<u8>) {
        self.0.give_back(buf);
    }
}

/// Why `ip` cannot be a udp address, if it cannot (for the configuration's
/// checks; see `net::unusable`).
pub(crate) fn unusable_addr(ip: IpAddr) -> Option<&'static str> {
    net::unusable(ip)
}

/// Check that ranks that would talk to each other over udp use one address
/// family. `ranks` holds every rank that publishes a udp address, with its
/// address and what it published (two ranks on one node that both run a
/// node-local transport such as `sm` talk over it, whatever their
/// families).
///
/// Every rank runs this on the same table (the whole address exchange), so
/// on a mixed job all of them fail at open with the same message, naming
/// the first such pair by rank; none is left waiting for a peer that gave
/// up. (An IPv4 socket cannot reach an IPv6 address, and our IPv6 sockets
/// are IPv6-only, so a mixed pair could never talk.)
fn check_families(ranks: &mut [(Rank, IpAddr, &Published)]) -> Result<()> {
    if ranks
        .windows(2)
        .all(|w| w[0].1.is_ipv4() == w[1].1.is_ipv4())
    {
        return Ok(());
    }
    ranks.sort_by_key(|r| r.0);
    for (i, a) in ranks.iter().enumerate() {
        for b in &ranks[i + 1..] {
            if a.1.is_ipv4() != b.1.is_ipv4() && !a.2.share_node_transport(b.2) {
                return Err(Error::Config(format!(
                    "udp: rank {} uses the {} address {} and rank {} the {} address {}: ranks that talk over udp must use one address family (set BTL_UDP_ADDR on every rank to addresses of one family; without it a host with a non-loopback IPv4 address uses IPv4)",
                    a.0,
                    net::family(a.1),
                    a.1,
                    b.0,
                    net::family(b.1),
                    b.1
                )));
            }
        }
    }
    Ok(())
}

/// What a fabric tells of its `udp` transport.
impl crate::Fabric {
    /// The UDP protocol counters of the connection to `peer`, when `udp`
    /// reaches it.
    pub fn udp_stats(&self, peer: Rank) -> Option<proto::Stats> {
        self.transport_of::<UdpTransport>()?.stats(peer)
    }

    /// The largest datagram (UDP payload, protocol header included) sent
    /// to `peer`, when `udp` reaches it: the path MTU less 28 bytes of IPv4
    /// and UDP headers, or 48 over IPv6 (at most 65507).
    pub fn udp_max_datagram(&self, peer: Rank) -> Option<usize> {
        self.transport_of::<UdpTransport>()?.max_datagram(peer)
    }

    /// The addresses of this process's UDP sockets (data, priority), when
    /// `udp` runs (it runs when some peer is reached through it).
    pub fn udp_addrs(&self) -> Option<(std::net::SocketAddr, std::net::SocketAddr)> {
        self.transport_of::<UdpTransport>().map(|u| u.local_addrs())
    }
}

/// Decode a peer's `udp` address.
pub(crate) fn decode_addr(rank: Rank, addr: &[u8]) -> Result<UdpAddr> {
    postcard::from_bytes(addr).map_err(|e| {
        Error::Bootstrap(format!(
            "rank {rank} published an unreadable udp address: {e}"
        ))
    })
}

/// Whether a UDP socket binds here, and what udp would bind.
fn probe() -> std::result::Result<String, String> {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .map(|s| {
            let (ip, mtu) = UdpTransport::default_bind();
            let at = match s.local_addr() {
                Ok(a) => a.to_string(),
                Err(_) => "127.0.0.1".to_string(),
            };
            format!(
                "a UDP socket binds on {at}; without BTL_UDP_ADDR udp binds {ip} (interface MTU {mtu})"
            )
        })
        .map_err(|e| format!("cannot bind a UDP socket on 127.0.0.1: {e}"))
}

/// The registry's entry: opened in a job of more than one rank.
#[linkme::distributed_slice(crate::transport::registry::TRANSPORTS)]
pub(crate) static ENTRY: Entry = Entry {
    rank: 40,
    name: "udp",
    messages: true,
    one_sided: false,
    implicit: false,
    device_memory: false,
    reach: crate::transport::registry::Reach::Network,
    not_built: None,
    probe,
    open: |core, job: &Job| {
        if job.size < 2 {
            return Ok(None);
        }
        Ok(Some(UdpTransport::new(core.clone())? as Arc<dyn Transport>))
    },
    alloc_shared: None,
};

fn mix(isn: u64, rank: Rank) -> u64 {
    isn ^ (u64::from(rank) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

impl UdpTransport {
    /// Bind our two sockets. Must run inside a tokio runtime.
    pub(crate) fn new(core: Arc<Core>) -> Result<Arc<UdpTransport>> {
        let ifs = net::interfaces();
        // A configured IPv4-mapped address (::ffff:a.b.c.d) means its IPv4
        // address: our IPv6 sockets are IPv6-only and could not use it.
        let config = core.config().udp.clone();
        let ip = config
            .addr
            .map(|a| a.to_canonical())
            .unwrap_or_else(|| net::default_addr(&ifs));
        if let Some(why) = net::unusable(ip) {
            return Err(Error::Config(format!(
                "udp: cannot use the address {ip}: {why}; set BTL_UDP_ADDR to an address of this host"
            )));
        }
        let (data, rcv) = net::bind(ip)?;
        let (prio, _) = net::bind(ip)?;
        let port = |s: &std::net::UdpSocket| s.local_addr().map(|a| a.port());
        let os = |what: &str| {
            let what = what.to_string();
            move |e| Error::Os {
                context: format!("udp: {what}"),
                source: e,
            }
        };
        let me = UdpAddr {
            ip,
            data_port: port(&data).map_err(os("reading the data port"))?,
            prio_port: port(&prio).map_err(os("reading the priority port"))?,
            isn: u64::from_le_bytes(crate::sys::os::random_bytes::<8>()),
            mtu: config.mtu.unwrap_or_else(|| net::mtu_of(&ifs, ip)) as u32,
            rcvbuf: u32::try_from(rcv).unwrap_or(u32::MAX),
            auth: config.auth.name().to_string(),
            salt: crate::sys::os::random_bytes::<16>(),
        };
        let off = offload::Offload::probe(std::os::fd::AsRawFd::as_raw_fd(&data), config.gso);
        let io = Sockets {
            off,
            data: tokio::net::UdpSocket::from_std(data)
                .map_err(os("registering the data socket"))?,
            prio: tokio::net::UdpSocket::from_std(prio)
                .map_err(os("registering the priority socket"))?,
        };
        let now = Instant::now();
        let trailer = config.auth.trailer_len();
        Ok(Arc::new(UdpTransport {
            keepalive: peer::keepalive_every(config.peer_timeout),
            config,
            job: core.job_tag()[0] ^ core.job_tag()[1].rotate_left(17),
            rx: Mutex::new(RxState::new(core.size() as usize, trailer)),
            core,
            io,
            me,
            ifs,
            peers: OnceLock::new(),
            by_addr: OnceLock::new(),
            kick: Notify::new(),
            armed: AtomicBool::new(false),
            foreign: AtomicU64::new(0),
            wake_at: AtomicU64::new(u64::MAX),
            backlog: AtomicBool::new(false),
            service_owed: AtomicBool::new(false),
            epoch: now,
            last_report: Mutex::new(now),
        }))
    }

    /// Our address for the exchange.
    fn udp_address(&self) -> UdpAddr {
        self.me.clone()
    }

    /// Whether a peer with this address can be reached: one of our family
    /// (a job that mixes families fails earlier, see `check_families`)
    /// that names one host; a loopback address reaches only this host.
    fn reaches_addr(&self, a: &UdpAddr) -> bool {
        let local = net::is_local(&self.ifs, a.ip);
        a.ip.is_ipv4() == self.me.ip.is_ipv4()
            && net::unusable(a.ip).is_none()
            && a.data_port != 0
            && a.prio_port != 0
            && (local || !self.me.ip.is_loopback())
    }

    /// Protocol settings towards a peer, and whether our datagrams to it
    /// fit our route whole (else GSO is not used towards it: the kernel
    /// would refuse the packets, and turn GSO off for every peer).
    fn proto_config(&self, a: &UdpAddr) -> (proto::Config, bool) {
        // The path's MTU as both ends see it (the configured one, loopback's,
        // or the smaller interface MTU): the windows follow from it, so the
        // peer's receive window is our send window, datagram for datagram.
        let shared = match self.config.mtu {
            Some(m) => m,
            None if net::is_local(&self.ifs, a.ip) => {
                let lo = if self.me.ip.is_ipv4() {
                    IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
                } else {
                    IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)
                };
                net::mtu_of(&self.ifs, lo)
            }
            None => self.me.mtu.min(a.mtu) as usize,
        };
        // Our datagrams also fit our route to the peer (a route, or a path
        // the kernel learned, may allow less than the interfaces: a tunnel,
        // say; above it datagrams would leave as IP fragments, and GSO
        // packets not at all). The peer does not know our route, so the
        // windows stay those of `shared`.
        let route = match self.config.mtu {
            None if !net::is_local(&self.ifs, a.ip) => net::route_mtu(self.me.ip, a.ip),
            _ => None,
        };
        // Both ends are of our family (`reaches`): its headers.
        let wdgram = net::payload_for_mtu(shared, self.me.ip);
        let dgram = net::payload_for_mtu(shared.min(route.unwrap_or(usize::MAX)), self.me.ip);
        // A window of datagrams must fit in the receiving socket's buffer,
        // counting the kernel's per-datagram overhead (about as much again
        // for small ones) and leaving half for other senders.
        // Capped at the protocol's default (256 datagrams), or at
        // WINDOW_BYTES in flight for small datagrams (an Ethernet path:
        // 712 of 1472 bytes; 256 kept a 1 MiB message waiting on ACKs, at
        // half the bandwidth with GSO on): several times a LAN's
        // bandwidth-delay product; more only adds queueing delay, which
        // slows loss repair (a round trip per wave of holes).
        let cap = self
            .config
            .window
            .unwrap_or_else(|| 256.max((WINDOW_BYTES / wdgram.max(1)) as u32))
            .clamp(4, 1 << 16);
        let window =
            |rcvbuf: u32| ((rcvbuf as usize / 2) / (wdgram + 1024)).clamp(4, cap as usize) as u32;
        let send_window = window(a.rcvbuf);
        let d = proto::Config::default();
        let cfg = proto::Config {
            max_datagram: dgram,
            send_window,
            recv_window: window(self.me.rcvbuf),
            send_budget: (4 << 20).max(2 * send_window as usize * dgram),
            peer_timeout: self.config.stall_timeout,
            guard: self.config.auth,
            ..d
        };
        let whole = route.map_or(true, |r| net::fits(dgram, r, self.me.ip));
        (cfg, whole)
    }

    /// The seal of our connection to `rank`, which published `a`: under a
    /// MAC, a key per direction derived from the job key, both ranks and
    /// both processes' salts.
    fn seal_for(&self, rank: Rank, a: &UdpAddr) -> Result<proto::Seal> {
        if a.auth != self.config.auth.name() {
            return Err(Error::Config(format!(
                "udp: rank {rank} guards its datagrams with {:?} and this rank with {:?}; set BTL_UDP_AUTH the same on every rank",
                a.auth,
                self.config.auth.name()
            )));
        }
        Ok(match self.config.auth {
            proto::Guard::Crc => proto::Seal::crc(),
            proto::Guard::Mac => {
                let me = self.core.rank();
                let job = self.job.to_le_bytes();
                let key = |from: Rank, to: Rank, s_from: &[u8; 16], s_to: &[u8; 16]| {
                    let k = self.core.derive_key(
                        b"udp datagram mac",
                        &[&job, &from.to_le_bytes(), &to.to_le_bytes(), s_from, s_to],
                    );
                    let mut out = [0u8; proto::seal::KEY_LEN];
                    out.copy_from_slice(&k[..proto::seal::KEY_LEN]);
                    out
                };
                proto::Seal::mac(
                    &key(me, rank, &self.me.salt, &a.salt),
                    &key(rank, me, &a.salt, &self.me.salt),
                )
            }
        })
    }

    /// Create a connection per peer; returns a link per peer rank.
    fn connect_addrs(
        self: &Arc<Self>,
        peers: &[(Rank, UdpAddr)],
    ) -> Result<Vec<(Rank, Arc<dyn Link>)>> {
        let now = Instant::now();
        let me = self.core.rank();
        let mut table: Vec<Option<Arc<Peer>>> = (0..self.core.size()).map(|_| None).collect();
        let mut by_addr = HashMap::new();
        let mut links: Vec<(Rank, Arc<dyn Link>)> = Vec::new();
        for (rank, a) in peers {
            let (cfg, whole) = self.proto_config(a);
            // A receive window of full datagrams: what the peer may have in
            // flight when we pause it.
            let stash_limit = cfg.recv_window as usize * (cfg.max_datagram + rx::STASH_OVERHEAD);
            let max_datagram = cfg.max_datagram;
            let ids = proto::ConnIds {
                job: self.job,
                local_rank: me,
                peer_rank: *rank,
            };
            let seal = self.seal_for(*rank, a)?;
            let mut conn = proto::Connection::with_seal(
                cfg,
                ids,
                mix(self.me.isn, *rank),
                mix(a.isn, me),
                now,
                seal,
            )
            .map_err(|e| Error::Config(e.to_string()))?;
            conn.set_buffers(Arc::new(Pool(self.core.buffers().clone())));
            let peer = Arc::new(Peer {
                rank: *rank,
                data_addr: SocketAddr::new(a.ip, a.data_port),
                prio_addr: SocketAddr::new(a.ip, a.prio_port),
                max_datagram,
                gso: AtomicBool::new(whole),
                stash_limit,
                lost: AtomicBool::new(false),
                lost_reason: OnceLock::new(),
                busy: AtomicBool::new(false),
                st: Mutex::new(PeerState::new(conn, now, self.config.bundle)),
            });
            for addr in [peer.data_addr, peer.prio_addr] {
                if by_addr.insert(addr, *rank).is_some() {
                    return Err(Error::Bootstrap(format!(
                        "two ranks published the udp address {addr}"
                    )));
                }
            }
            let slot = table
                .get_mut(*rank as usize)
                .ok_or_else(|| Error::Bootstrap(format!("udp peer rank {rank} out of range")))?;
            *slot = Some(peer.clone());
            links.push((
                *rank,
                Arc::new(link::UdpLink {
                    t: self.clone(),
                    peer,
                }),
            ));
        }
        self.peers
            .set(table)
            .map_err(|_| Error::Misuse("udp transport connected twice".into()))?;
        let _ = self.by_addr.set(by_addr);
        Ok(links)
    }

    pub(crate) fn peer(&self, rank: Rank) -> Option<&Arc<Peer>> {
        self.peers.get()?.get(rank as usize)?.as_ref()
    }

    fn peer_list(&self) -> impl Iterator<Item = &Arc<Peer>> {
        self.peers.get().into_iter().flatten().flatten()
    }

    /// Our sockets' addresses: (data, priority).
    pub(crate) fn local_addrs(&self) -> (SocketAddr, SocketAddr) {
        (
            SocketAddr::new(self.me.ip, self.me.data_port),
            SocketAddr::new(self.me.ip, self.me.prio_port),
        )
    }

    /// The address udp binds without `BTL_UDP_ADDR`, and its interface's
    /// MTU.
    pub(crate) fn default_bind() -> (IpAddr, usize) {
        let ifs = net::interfaces();
        let ip = net::default_addr(&ifs);
        (ip, net::mtu_of(&ifs, ip))
    }

    /// Whether this kernel offers UDP GSO and GRO (a socket is made to ask).
    pub(crate) fn kernel_offload() -> (bool, bool) {
        match std::net::UdpSocket::bind((std::net::Ipv4Addr::LOCALHOST, 0)) {
            Ok(s) => {
                let o = offload::Offload::probe(std::os::fd::AsRawFd::as_raw_fd(&s), true);
                (o.gso(), o.gro())
            }
            Err(_) => (false, false),
        }
    }

    /// Add the transport's own counters to a fabric's.
    fn add_stats(&self, s: &mut crate::Stats) {
        let g = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        s.udp.gso_sends = g(&self.io.off.gso_sends);
        s.udp.gro_receives = g(&self.io.off.gro_receives);
        s.udp.gso_refusals = g(&self.io.off.refusals);
        s.udp.foreign_datagrams = g(&self.foreign);
        s.udp.bad_trailers = self
            .peers
            .get()
            .into_iter()
            .flatten()
            .flatten()
            .map(|p| lock(&p.st).conn.stats().checksum_errors)
            .sum();
    }

    /// The largest datagram (UDP payload) sent to `rank`.
    pub(crate) fn max_datagram(&self, rank: Rank) -> Option<usize> {
        self.peer(rank).map(|p| p.max_datagram)
    }

    /// The protocol counters of the connection to `rank`.
    pub(crate) fn stats(&self, rank: Rank) -> Option<proto::Stats> {
        self.peer(rank).map(|p| lock(&p.st).conn.stats())
    }

    fn stall_reason(&self) -> String {
        format!(
            "it acknowledged none of our data for {:?} though it answers keepalives (does the path drop large datagrams? set BTL_UDP_MTU)",
            self.config.stall_timeout
        )
    }

    /// Declare a peer lost: fail its queue, tell the core.
    pub(crate) fn lose(&self, rank: Rank, reason: &str) {
        let Some(peer) = self.peer(rank) else {
            return;
        };
        // The first cause wins; readers that see `lost` see it.
        let _ = peer.lost_reason.set(reason.to_string());
        // Pairs with the Acquire load in `Peer::is_lost`.
        if peer.lost.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::warn!(peer = rank, "udp peer lost: {reason}");
        lock(&peer.st).fail_queue(rank, reason);
        // Nothing of ours is exposed to a udp peer's memory operations: any
        // loss releases everything.
        self.core
            .on_peer_lost(rank, reason, crate::transport::Loss::Crashed);
    }

    fn nanos(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// After a send from a user task (called with the peer's state still
    /// locked): lower `wake_at` to the connection's new deadline, note a
    /// backlog, and wake a parked progress task if it must act sooner than
    /// it planned to.
    /// A peer holds a gathered bundle: the next progress call runs the
    /// service pass, which sends it.
    pub(crate) fn hold_bundle(&self) {
        self.backlog.store(true, Ordering::Relaxed);
    }

    pub(crate) fn after_send(&self, st: &PeerState) {
        let due = st.poll_timeout().map_or(u64::MAX, |t| self.nanos(t));
        // AcqRel: pairs with the loads in `progress` and `wait` and with the
        // compare-exchange in `publish_wake_at`.
        let planned = self.wake_at.fetch_min(due, Ordering::AcqRel);
        let backlog = st.has_backlog();
        if backlog {
            self.backlog.store(true, Ordering::Relaxed);
        }
        // Pairs with the SeqCst store in `arm`: either we see the task armed,
        // or it computes its wake time after our change.
        if self.armed.load(Ordering::SeqCst) && (backlog || due < planned) {
            self.kick.notify_one();
        }
    }

    /// Timers, queues, transmissions, keepalives and liveness of every
    /// peer. Returns work done.
    fn service(&self, now: Instant) -> usize {
        let mut work = 0;
        let mut lost: Vec<(Rank, String)> = Vec::new();
        let mut silent: Vec<Rank> = Vec::new();
        let mut next = u64::MAX;
        // Acquire: pairs with the AcqRel updates in `after_send`.
        let planned = self.wake_at.load(Ordering::Acquire);
        // Cleared before the walk, set again after it if a peer still has a
        // backlog: a user send that sets it meanwhile is not overwritten.
        self.backlog.store(false, Ordering::Relaxed);
        let mut backlog = false;
        let timeout = self.config.peer_timeout;
        for p in self.peer_list() {
            if p.is_lost() {
                continue;
            }
            let mut st = lock(&p.st);
            if st.conn.poll_timeout().is_some_and(|t| t <= now) {
                st.conn.handle_timeout(now);
            }
            while let Some(ev) = st.conn.poll_event() {
                if ev == proto::Event::PeerLost {
                    lost.push((p.rank, self.stall_reason()));
                }
            }
            work += st.push_queue(now, p.rank);
            work += st.flush(now, &self.io, p, usize::MAX);
            if now.saturating_duration_since(st.last_sent) >= self.keepalive {
                st.keepalive(&self.io, p, self.job, self.core.rank());
            }
            if now.saturating_duration_since(st.last_heard) > timeout {
                silent.push(p.rank);
            }
            backlog |= st.has_backlog();
            for t in [
                st.poll_timeout(),
                Some(st.last_sent + self.keepalive),
                Some(st.last_heard + timeout),
            ]
            .into_iter()
            .flatten()
            {
                next = next.min(self.nanos(t));
            }
        }
        publish_wake_at(&self.wake_at, planned, next);
        if backlog {
            self.backlog.store(true, Ordering::Relaxed);
        }
        if !silent.is_empty() {
            // Before calling a peer lost, read what is already queued for
            // us: after a stall of our own (this process was stopped, or
            // starved of CPU), its keepalives may be waiting in our sockets
            // behind other traffic.
            let now = Instant::now();
            work += self.drain(now);
            for r in silent {
                let heard = self.peer(r).map(|p| lock(&p.st).last_heard);
                if heard.is_some_and(|h| now.saturating_duration_since(h) > timeout) {
                    lost.push((
                        r,
                        format!("nothing heard from it for {timeout:?} (BTL_UDP_PEER_TIMEOUT_MS)"),
                    ));
                }
            }
        }
        for (r, why) in lost {
            self.lose(r, &why);
        }
        work
    }

    fn report(&self) {
        if !tracing::enabled!(tracing::Level::DEBUG) {
            return;
        }
        let now = Instant::now();
        {
            let mut last = lock(&self.last_report);
            if now.saturating_duration_since(*last) < REPORT_EVERY {
                return;
            }
            *last = now;
        }
        for p in self.peer_list() {
            let s = lock(&p.st).conn.stats();
            tracing::debug!(peer = p.rank, lost = p.is_lost(), "udp stats: {s}");
        }
    }
}

#[async_trait]
impl Transport for UdpTransport {
    fn name(&self) -> &'static str {
        "udp"
    }

    fn address(&self) -> Result<Vec<u8>> {
        postcard::to_allocvec(&self.udp_address())
            .map_err(|e| Error::Bootstrap(format!("encoding our udp address: {e}")))
    }

    fn reaches(&self, peer: &PeerInfo<'_>) -> Result<bool> {
        Ok(self.reaches_addr(&decode_addr(peer.rank, peer.addr)?))
    }

    fn check_job(&self, job: &[Published]) -> Result<()> {
        let mut ranks = Vec::new();
        for p in job {
            if let Some(a) = p.addr("udp") {
                let a = decode_addr(p.rank, a)?;
                if a.auth != self.config.auth.name() {
                    return Err(Error::Config(format!(
                        "udp: rank {} guards its datagrams with {:?} and rank {} with {:?}; set BTL_UDP_AUTH the same on every rank",
                        p.rank,
                        a.auth,
                        self.core.rank(),
                        self.config.auth.name()
                    )));
                }
                ranks.push((p.rank, a.ip, p));
            }
        }
        check_families(&mut ranks)
    }

    fn connect(self: Arc<Self>, peers: &[PeerInfo<'_>]) -> Result<Vec<(Rank, Arc<dyn Link>)>> {
        let addrs = peers
            .iter()
            .map(|p| Ok((p.rank, decode_addr(p.rank, p.addr)?)))
            .collect::<Result<Vec<_>>>()?;
        self.connect_addrs(&addrs)
    }

    fn add_stats(&self, s: &mut crate::Stats) {
        UdpTransport::add_stats(self, s);
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn progress(&self) -> usize {
        let mut work = 0;
        let mut timers = true;
        // A service pass the last call put off runs first.
        let mut serviced = false;
        if self.service_owed.load(Ordering::Relaxed)
            && self.service_owed.swap(false, Ordering::Relaxed)
        {
            work += self.service(Instant::now());
            serviced = true;
        }
        let mut received = 0;
        let mut put_off = false;
        if let Ok(mut rx) = self.rx.try_lock() {
            received = self.rx_progress(&mut rx);
            timers = rx.timer_turn();
            // Messages were delivered and no peer has anything to send now
            // (the ACK they want may ride on a reply, or waits for a
            // deadline): the service pass waits for the next call, after
            // the receiver had its message and could answer. The next
            // call comes at once while anyone polls; a parking driver
            // runs it in `arm`.
            // (Nor when a bundle was gathered meanwhile, answers to the
            // requests just read, say: it leaves in this call's pass.)
            put_off = received > 0
                && rx.delivered > 0
                && !rx.urgent
                && !self.backlog.load(Ordering::Relaxed);
        }
        work += received;
        if put_off {
            // Whichever progress call sees it runs the pass, and `arm`
            // always does. A driver that armed (and ran its pass) before
            // these messages were fed is woken to run it again: SeqCst
            // pairs with the store and load in `arm` and `after_send`.
            self.service_owed.store(true, Ordering::SeqCst);
            if self.armed.load(Ordering::SeqCst) {
                self.kick.notify_one();
            }
            return work;
        }
        // Timers, queues and keepalives only change when something arrived,
        // a deadline passed, or the kernel refused datagrams (user sends
        // lower `wake_at` themselves): a hot poll that found nothing skips
        // the walk over every peer, and reads the clock for the timers only
        // now and then.
        let now = if received > 0 || self.backlog.load(Ordering::Relaxed) {
            Some(Instant::now())
        } else if timers && !serviced {
            let now = Instant::now();
            // Acquire: pairs with the AcqRel updates in `after_send`.
            (self.nanos(now) >= self.wake_at.load(Ordering::Acquire)).then_some(now)
        } else {
            None
        };
        if let Some(now) = now {
            work += self.service(now);
        }
        work
    }

    fn arm(&self) -> bool {
        // Pairs with the SeqCst load in `after_send`.
        self.armed.store(true, Ordering::SeqCst);
        // Sockets need no arming: tokio's readiness is only cleared by a
        // receive that found nothing, so data that came after our last
        // receive wakes `wait`. Held messages wait for the dispatcher's
        // `space` signal, which the driver also waits on.
        self.service(Instant::now());
        true
    }

    fn disarm(&self) {
        self.armed.store(false, Ordering::SeqCst);
    }

    async fn wait(&self, timeout: Duration) {
        let due = self.wake_at.load(Ordering::Acquire);
        let now = self.nanos(Instant::now());
        let until = Duration::from_nanos(due.saturating_sub(now)).min(timeout);
        let backlog = self.backlog.load(Ordering::Relaxed);
        tokio::select! {
            _ = self.io.data.readable() => {}
            _ = self.io.prio.readable() => {}
            _ = self.io.data.writable(), if backlog => {}
            _ = self.io.prio.writable(), if backlog => {}
            _ = self.kick.notified() => {}
            _ = tokio::time::sleep(until) => {}
        }
    }

    fn check_peers(&self) {
        self.service(Instant::now());
        self.report();
    }

    fn drained(&self) -> bool {
        self.peer_list()
            .all(|p| p.is_lost() || lock(&p.st).is_idle())
    }

    fn undrained(&self) -> Vec<String> {
        self.peer_list()
            .filter(|p| !p.is_lost())
            .filter_map(|p| {
                let st = lock(&p.st);
                let ids = st.conn.unacked_messages();
                (!st.is_idle()).then(|| {
                    format!(
                        "udp rank {}: {} messages unacknowledged (ids {:?}{}){}",
                        p.rank,
                        ids.len(),
                        &ids[..ids.len().min(8)],
                        if ids.len() > 8 { ", ..." } else { "" },
                        if st.holds_messages() {
                            ", and messages not yet handed to the protocol"
                        } else {
                            ""
                        }
                    )
                })
            })
            .collect()
    }

    fn shutdown(&self) {
        for s in self.undrained() {
            tracing::warn!("closing with {s}");
        }
        for p in self.peers.get().into_iter().flatten().flatten() {
            lock(&p.st).fail_queue(p.rank, "this fabric closed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lowered_deadline_survives_a_concurrent_walk() {
        // A walk began with wake_at at 1000 and computed 900; nothing
        // changed meanwhile: its value is stored, later or earlier.
        let w = AtomicU64::new(1000);
        publish_wake_at(&w, 1000, 900);
        assert_eq!(w.load(Ordering::Relaxed), 900);
        publish_wake_at(&w, 900, 5000);
        assert_eq!(w.load(Ordering::Relaxed), 5000);
        // A walk began at 5000 and computed 4000, but a send lowered
        // wake_at to 300 for a peer it had already walked past: 300 stays.
        let planned = w.load(Ordering::Relaxed);
        w.fetch_min(300, Ordering::AcqRel);
        publish_wake_at(&w, planned, 4000);
        assert_eq!(w.load(Ordering::Relaxed), 300);
        // The walk's own deadline is still taken when it is the earlier.
        let planned = w.load(Ordering::Relaxed);
        w.fetch_min(200, Ordering::AcqRel);
        publish_wake_at(&w, planned, 100);
        assert_eq!(w.load(Ordering::Relaxed), 100);
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// `check_families` on a table of (rank, udp address, the node when
    /// the rank also runs sm).
    fn families(ranks: &mut [(Rank, IpAddr, Option<&str>)]) -> Result<()> {
        let published: Vec<Published> = ranks
            .iter()
            .map(|(r, _, node)| Published {
                rank: *r,
                node: node.map_or(format!("alone-{r}"), str::to_string),
                addrs: node
                    .map(|_| ("sm".to_string(), Vec::new()))
                    .into_iter()
                    .collect(),
            })
            .collect();
        let mut table: Vec<(Rank, IpAddr, &Published)> = ranks
            .iter()
            .zip(&published)
            .map(|((r, ip, _), p)| (*r, *ip, p))
            .collect();
        check_families(&mut table)
    }

    #[test]
    fn one_family_per_job() {
        let v4 = ip("192.0.2.1");
        let v6 = ip("fd00::1");
        // One family: fine, whatever the nodes.
        let mut same = [(0, v4, None), (1, ip("192.0.2.2"), Some("a"))];
        assert!(families(&mut same).is_ok());
        let mut same6 = [(0, v6, None), (1, ip("::1"), None)];
        assert!(families(&mut same6).is_ok());
        // Mixed, over udp: every rank gets the same message, naming the
        // first pair by rank, whatever order its table came in.
        let mut a = [(2, v4, None), (1, v6, None), (0, v4, None)];
        let mut b = [(0, v4, None), (2, v4, None), (1, v6, None)];
        let ea = families(&mut a).unwrap_err().to_string();
        let eb = families(&mut b).unwrap_err().to_string();
        assert_eq!(ea, eb);
        assert!(matches!(
            families(&mut [(0, v4, None), (1, v6, None)]),
            Err(Error::Config(_))
        ));
        for want in ["rank 0", "192.0.2.1", "IPv4", "rank 1", "fd00::1", "IPv6"] {
            assert!(ea.contains(want), "{want:?} missing from {ea}");
        }
        // Mixed, but the pair talks over shared memory (one node, both
        // run sm): fine. Another node, or no sm on one side: not.
        let mut by_sm = [(0, v4, Some("n1")), (1, v6, Some("n1"))];
        assert!(families(&mut by_sm).is_ok());
        let mut other_node = [(0, v4, Some("n1")), (1, v6, Some("n2"))];
        assert!(families(&mut other_node).is_err());
        let mut no_sm = [(0, v4, Some("n1")), (1, v6, None)];
        assert!(families(&mut no_sm).is_err());
        let mut third = [
            (0, v4, Some("n1")),
            (1, v6, Some("n1")),
            (2, v4, Some("n2")),
        ];
        let e = families(&mut third).unwrap_err().to_string();
        assert!(e.contains("rank 1") && e.contains("rank 2"), "{e}");
    }

    #[test]
    fn ipv6_addresses_survive_the_exchange_encoding() {
        for a in ["::1", "fd00::2", "2001:db8::dead:beef", "127.0.0.1"] {
            let u = UdpAddr {
                ip: ip(a),
                data_port: 40_000,
                prio_port: 40_001,
                isn: 7,
                mtu: 65_536,
                rcvbuf: 1 << 20,
                auth: "mac".into(),
                salt: [3; 16],
            };
            let raw = postcard::to_allocvec(&u).unwrap();
            let back: UdpAddr = postcard::from_bytes(&raw).unwrap();
            assert_eq!(
                (back.ip, back.data_port, back.prio_port),
                (u.ip, 40_000, 40_001)
            );
        }
    }

    #[test]
    fn peer_table_keys_match_only_the_published_family() {
        // Keyed as `connect` keys them; looked up with what the receive
        // path reads from the kernel (`io::to_addr`: no flow label, no
        // scope id, mapped forms left as IPv6).
        let v4 = SocketAddr::new(ip("127.0.0.1"), 4000);
        let v6 = SocketAddr::new(ip("::1"), 4000);
        let table: HashMap<SocketAddr, Rank> = [(v4, 1), (v6, 2)].into_iter().collect();
        assert_eq!(table.get(&"127.0.0.1:4000".parse().unwrap()), Some(&1));
        assert_eq!(table.get(&"[::1]:4000".parse().unwrap()), Some(&2));
        // The IPv4-mapped form of the IPv4 peer is neither peer.
        assert_eq!(table.get(&"[::ffff:127.0.0.1]:4000".parse().unwrap()), None);
        // Same address, another port: unknown.
        assert_eq!(table.get(&"[::1]:4001".parse().unwrap()), None);
        // A published mapped address never enters the table.
        assert!(net::unusable(ip("::ffff:127.0.0.1")).is_some());
    }
}

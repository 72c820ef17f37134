//! The library half of `btl-perf`: point-to-point benchmarks in the manner
//! of the OSU micro-benchmarks and `ucx_perftest`, run over async-btl and,
//! with the very same code, over tokio sockets as baselines.
//!
//! Every measurement is written once against [`wire::Wire`]: a way to send
//! and receive messages of a known length. [`wire::BtlWire`] sends through
//! an [`Endpoint`](async_btl::Endpoint); [`wire::StreamWire`] over a tokio
//! `UnixStream` or `TcpStream`; [`wire::UdpWire`] over a pair of connected
//! tokio `UdpSocket`s (messages above 64 KiB are cut into datagrams of
//! [`wire::UDP_CHUNK`] bytes, under a credit window so loopback never drops).
//!
//! Module map: [`wire`] (the transports under test), [`method`] (what each
//! test does on each side), [`plan`] (iterations per size), [`machine`] (the
//! report header), [`floor`] (the machine's own hop, read around each run), [`report`] (table, JSON, CSV), [`plot`] (SVG), [`pin`]
//! (CPU affinity), [`session`] (one rank's whole run), [`tool`] (running
//! the baselines' external tools and built-in C programs), [`ompi`] (Open MPI
//! as a baseline, run under its own `mpirun`), [`ofi`] (libfabric itself
//! as a baseline, a C program on the `rdma` transport's provider), [`ucx`]
//! (UCX as a baseline, through its own `ucx_perftest`).
//!
//! Nothing here asserts a speed: it measures and reports.

pub mod floor;
pub mod machine;
pub mod method;
pub mod ofi;
pub mod ompi;
pub mod pin;
pub mod plan;
pub mod plot;
pub mod report;
pub mod session;
pub mod tool;
pub mod ucx;
pub mod wire;

use serde::{Deserialize, Serialize};

/// One kind of measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Test {
    /// Ping-pong; half the round trip, in µs.
    Lat,
    /// One direction, a window of outstanding sends, the receiver acks each
    /// window; MB/s.
    Bw,
    /// Both directions at once, a window each way; MB/s of both together.
    Bibw,
    /// A put that resolves at remote completion, one at a time; µs per put.
    PutLat,
    /// A window of puts, then a flush; MB/s.
    PutBw,
    /// A get, one at a time; µs per get.
    GetLat,
    /// A window of gets, then a flush; MB/s.
    GetBw,
    /// 8-byte messages in windows, one direction; messages per second.
    MsgRate,
    /// A remote `fetch_add` on an 8-byte word, one at a time; µs per
    /// operation (the previous value back: remote completion).
    AtomicLat,
    /// A remote `compare_swap` on an 8-byte word (one that succeeds), one
    /// at a time; µs per operation.
    AtomicCswapLat,
    /// Windows of non-fetching `atomic_add_nbi`, each followed by a flush;
    /// operations per second.
    AtomicRate,
}

impl Test {
    /// Every test, in report order.
    pub const ALL: [Test; 11] = [
        Test::Lat,
        Test::Bw,
        Test::Bibw,
        Test::PutLat,
        Test::PutBw,
        Test::GetLat,
        Test::GetBw,
        Test::MsgRate,
        Test::AtomicLat,
        Test::AtomicCswapLat,
        Test::AtomicRate,
    ];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Test::Lat => "lat",
            Test::Bw => "bw",
            Test::Bibw => "bibw",
            Test::PutLat => "put_lat",
            Test::PutBw => "put_bw",
            Test::GetLat => "get_lat",
            Test::GetBw => "get_bw",
            Test::MsgRate => "msg_rate",
            Test::AtomicLat => "atomic_lat",
            Test::AtomicCswapLat => "atomic_cswap_lat",
            Test::AtomicRate => "atomic_rate",
        }
    }

    /// What the test reports.
    pub fn unit(self) -> Unit {
        match self {
            Test::Lat | Test::PutLat | Test::GetLat => Unit::Micros,
            Test::AtomicLat | Test::AtomicCswapLat => Unit::Micros,
            Test::Bw | Test::Bibw | Test::PutBw | Test::GetBw => Unit::MBps,
            Test::MsgRate => Unit::MsgPerSec,
            Test::AtomicRate => Unit::OpsPerSec,
        }
    }

    /// Whether the test is a remote atomic on one 8-byte word.
    pub fn is_atomic(self) -> bool {
        matches!(
            self,
            Test::AtomicLat | Test::AtomicCswapLat | Test::AtomicRate
        )
    }

    /// The one size a test always runs at, whatever the sizes asked for:
    /// 8 bytes for `msg_rate` (8-byte messages) and for the atomics (one
    /// 8-byte word); `None` for the tests that run at every size.
    pub fn fixed_size(self) -> Option<usize> {
        (self == Test::MsgRate || self.is_atomic()).then_some(8)
    }

    /// Whether the test streams windows (as opposed to one operation at a time).
    pub fn windowed(self) -> bool {
        self.unit() != Unit::Micros
    }

    /// The message sizes the test runs at, given the requested range.
    /// A test with a [`fixed_size`](Self::fixed_size) runs at that alone.
    pub fn sizes(self, min: usize, max: usize) -> Vec<usize> {
        if let Some(n) = self.fixed_size() {
            return vec![n];
        }
        let mut v = Vec::new();
        let mut s = min.max(1).next_power_of_two();
        while s <= max {
            v.push(s);
            match s.checked_mul(2) {
                Some(n) => s = n,
                None => break,
            }
        }
        v
    }
}

impl std::fmt::Display for Test {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Test {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Test::ALL
            .into_iter()
            .find(|t| t.name() == s.trim().to_ascii_lowercase().replace('-', "_"))
            .ok_or_else(|| {
                let names: Vec<_> = Test::ALL.iter().map(|t| t.name()).collect();
                format!("unknown test {s:?}; choose from {}", names.join(", "))
            })
    }
}

/// The unit of a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Unit {
    /// Microseconds (lower is better).
    #[serde(rename = "us")]
    Micros,
    /// 10^6 bytes per second (higher is better), as the OSU benchmarks.
    #[serde(rename = "MB/s")]
    MBps,
    /// Messages per second (higher is better).
    #[serde(rename = "msg/s")]
    MsgPerSec,
    /// Operations (remote atomics) per second (higher is better).
    #[serde(rename = "op/s")]
    OpsPerSec,
}

impl Unit {
    /// The unit's short name.
    pub fn label(self) -> &'static str {
        match self {
            Unit::Micros => "us",
            Unit::MBps => "MB/s",
            Unit::MsgPerSec => "msg/s",
            Unit::OpsPerSec => "op/s",
        }
    }

    /// Whether a larger value is better.
    pub fn higher_is_better(self) -> bool {
        self != Unit::Micros
    }
}

/// A baseline measured in the same run: a tokio socket, with the same
/// method and in the same processes, or (opt-in) Open MPI, UCX or raw
/// libfabric, with the same sizes and counts in their own two processes
/// ([`ompi`], [`ucx`], [`ofi`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Baseline {
    /// tokio `UnixStream` (abstract-namespace socket).
    Unix,
    /// tokio `TcpStream` on 127.0.0.1, `TCP_NODELAY` set.
    Tcp,
    /// tokio `UdpSocket` on 127.0.0.1, messages above 64 KiB chunked.
    Udp,
    /// Open MPI's shared-memory BTL (`--mca btl self,vader`).
    Ompi,
    /// Open MPI's TCP BTL on loopback (`--mca btl self,tcp`).
    #[serde(rename = "ompi-tcp")]
    OmpiTcp,
    /// UCX's `ucx_perftest` over its shared-memory transports.
    Ucx,
    /// UCX's `ucx_perftest` over its TCP transport on loopback.
    #[serde(rename = "ucx-tcp")]
    UcxTcp,
    /// libfabric itself (a C program, `baseline/ofi_pp.c`) on the provider
    /// the `rdma` transport uses (`tcp;ofi_rxm` on 127.0.0.1 by default).
    Ofi,
}

impl Baseline {
    /// Every baseline, in report order.
    pub const ALL: [Baseline; 8] = [
        Baseline::Unix,
        Baseline::Tcp,
        Baseline::Udp,
        Baseline::Ompi,
        Baseline::OmpiTcp,
        Baseline::Ucx,
        Baseline::UcxTcp,
        Baseline::Ofi,
    ];

    /// Name in reports and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Baseline::Unix => "unix",
            Baseline::Tcp => "tcp",
            Baseline::Udp => "udp",
            Baseline::Ompi => "ompi",
            Baseline::OmpiTcp => "ompi-tcp",
            Baseline::Ucx => "ucx",
            Baseline::UcxTcp => "ucx-tcp",
            Baseline::Ofi => "ofi",
        }
    }

    /// Whether this is Open MPI (as opposed to a tokio socket or UCX).
    pub fn is_mpi(self) -> bool {
        matches!(self, Baseline::Ompi | Baseline::OmpiTcp)
    }

    /// Whether this is UCX's `ucx_perftest` (over any of its transports).
    pub fn is_ucx(self) -> bool {
        matches!(self, Baseline::Ucx | Baseline::UcxTcp)
    }

    /// Whether this runs in processes of its own, started by rank 0 after
    /// everything else (Open MPI, UCX, libfabric), as opposed to a tokio
    /// socket in the ranks themselves.
    pub fn is_external(self) -> bool {
        self.is_mpi() || self.is_ucx() || self == Baseline::Ofi
    }

    /// Whether this baseline measures `test`. UDP has no `bibw`: its credit
    /// protocol would need one socket read from two places at once. Open
    /// MPI and libfabric run what their programs implement
    /// ([`ompi::supports`], [`ofi::supports`]), UCX what its tool measures
    /// the same way ([`ucx::supports`]).
    pub fn measures(self, test: Test) -> bool {
        match self {
            Baseline::Udp => test != Test::Bibw,
            Baseline::Ompi | Baseline::OmpiTcp => ompi::supports(test),
            Baseline::Ucx | Baseline::UcxTcp => ucx::supports(test),
            Baseline::Ofi => ofi::supports(test),
            Baseline::Unix | Baseline::Tcp => true,
        }
    }
}

impl std::str::FromStr for Baseline {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim().to_ascii_lowercase();
        Baseline::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Baseline::ALL.iter().map(|b| b.name()).collect();
                format!("unknown baseline {s:?}; choose from {}", names.join(", "))
            })
    }
}

/// One measured point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The test.
    pub test: Test,
    /// What carried it: `async-btl/<transport>`, or a baseline's name.
    pub wire: String,
    /// Message size in bytes.
    pub size: usize,
    /// The measured value, in `unit`.
    pub value: f64,
    /// The value's unit.
    pub unit: Unit,
    /// Timed iterations (windows, for windowed tests).
    pub iters: u64,
    /// Untimed iterations before them.
    pub warmup: u64,
    /// Operations in flight per iteration (1 for latency tests).
    pub window: u64,
}

/// The names of the tests `keep` admits, comma-separated, in report order.
pub fn test_names(keep: impl Fn(Test) -> bool) -> String {
    let names: Vec<&str> = Test::ALL
        .into_iter()
        .filter(|t| keep(*t))
        .map(Test::name)
        .collect();
    names.join(", ")
}

/// The label of async-btl rows for a transport name.
pub fn btl_label(transport: &str) -> String {
    format!("async-btl/{transport}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_powers_of_two_in_range() {
        assert_eq!(Test::Lat.sizes(1, 16), vec![1, 2, 4, 8, 16]);
        assert_eq!(Test::Bw.sizes(3, 20), vec![4, 8, 16]);
        assert_eq!(Test::MsgRate.sizes(1, 1 << 20), vec![8]);
        for t in [Test::AtomicLat, Test::AtomicCswapLat, Test::AtomicRate] {
            assert_eq!(t.sizes(64, 1 << 20), vec![8], "{t}: one 8-byte word");
        }
        assert!(Test::AtomicRate.windowed() && !Test::AtomicLat.windowed());
        assert!(Test::Lat.sizes(64, 8).is_empty());
    }

    #[test]
    fn names_round_trip() {
        for t in Test::ALL {
            assert_eq!(t.name().parse::<Test>(), Ok(t));
        }
        assert!("nope".parse::<Test>().is_err());
        for b in Baseline::ALL {
            assert_eq!(b.name().parse::<Baseline>(), Ok(b));
            assert_eq!(serde_json::to_value(b).unwrap(), b.name());
        }
        assert!(Baseline::OmpiTcp.measures(Test::PutBw) && !Baseline::Ompi.measures(Test::GetLat));
        assert!(Baseline::Ofi.measures(Test::GetBw) && !Baseline::Ofi.measures(Test::Bibw));
        assert!(Baseline::UcxTcp.measures(Test::Lat) && !Baseline::UcxTcp.measures(Test::PutLat));
        assert!(Baseline::Ofi.is_external() && Baseline::UcxTcp.is_external());
    }
}

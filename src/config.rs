//! Tunables, with defaults chosen from measurements (see ARCHITECTURE.md).
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
    /// default: on some CPUs `memmove`'s `rep movsb` lowers the core's
    /// clock after a few ms of copying, and the loop does not (see
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

/// Who checks the peers' liveness while no progress task can run: a user
/// loop that never yields keeps a current-thread runtime's progress tasks
/// from running, yet a dead peer must still fail what waits on it, and
/// silence-timed peers (`udp`, `rdma`) must still hear from this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Liveness {
    /// A thread of the fabric's own (`btl-liveness`) checks the peers,
    /// and sends the keep-alives of `udp` and `rdma`, whenever the
    /// progress tasks missed three heartbeats: a process may compute for
    /// longer than the peer timeouts without yielding. The default.
    #[default]
    Thread,
    /// No thread while the process has only one: the progress tasks and
    /// the library calls a user loop makes (`try_recv`, polls of the
    /// fabric's futures) check the peers, and the thread starts once the
    /// process is seen to have several (at the next heartbeat of a
    /// progress task or the next such call: a process that starts a thread
    /// and at once blocks its runtime's only thread has no watch until it
    /// calls the library again). A single-threaded process keeps the C
    /// library's single-thread fast paths (glibc then takes mutexes, as
    /// libfabric does for each message, and makes system calls more
    /// cheaply), at a price: a loop that neither yields nor calls the library for
    /// longer than the `udp` or `rdma` peer timeout is taken for dead by
    /// those peers. On other C libraries than glibc, the same as `Thread`.
    /// `sm` hands its memory to same-node peers from a thread of its own
    /// (`btl-share`), so a process with `sm` peers has several threads
    /// anyway: this is for ranks alone on their node (`rdma`, `udp`).
    Inline,
}

impl std::str::FromStr for Liveness {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "thread" => Ok(Liveness::Thread),
            "inline" => Ok(Liveness::Inline),
            other => Err(Error::Config(format!(
                "unknown liveness mode {other:?}: use thread or inline"
            ))),
        }
    }
}

/// Settings of a [`Fabric`](crate::Fabric).
///
/// Start from [`Config::from_env`] (defaults with the `BTL_*` variables
/// applied) or `Config::default()`, change fields, and hand it to
/// [`Fabric::from_job`](crate::Fabric::from_job) or a
/// [`FabricBuilder`](crate::FabricBuilder):
///
/// ```no_run
/// # async fn demo() -> async_btl::Result<()> {
/// use async_btl::{bootstrap::JobInfo, Config, Fabric, ProgressMode};
/// let config = Config {
///     progress: ProgressMode::BusyPoll,
///     ..Config::from_env()?
/// };
/// let job = JobInfo::from_env()?.expect("started by a launcher");
/// let fabric = Fabric::from_job(job, config).await?;
/// # fabric.close().await }
/// ```
#[derive(Debug, Clone)]
pub struct Config {
    /// Progress policy for every transport. Env: `BTL_PROGRESS`.
    pub progress: ProgressMode,
    /// How long an `Adaptive` progress task keeps polling after its last work
    /// before it parks. Env: `BTL_SPIN_US`.
    pub spin: Duration,
    /// How often peers are checked for liveness. Env: `BTL_HEARTBEAT_MS`.
    pub heartbeat: Duration,
    /// Who checks the peers while the progress tasks cannot run (see
    /// [`Liveness`]). Env: `BTL_LIVENESS` (`thread`, `inline`).
    pub liveness: Liveness,
    /// The routine for copies from 32 KiB to below half the L2 (see
    /// [`CopyMode`]).
    /// Env: `BTL_COPY` (`auto`, `libc`, `vector`).
    pub copy: CopyMode,
    /// Settings of the `sm` transport (`BTL_SM_*`).
    pub sm: crate::SmConfig,
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
    /// Emulated one-sided operations (put, get, atomics and flush over
    /// messages) waiting on a peer that has answered none of them for this
    /// long, while its link held nothing of ours still to send, fail with
    /// [`Error::Timeout`], even if the peer still
    /// looks alive: none waits forever for an answer that never comes.
    /// Answers that keep coming, or our data still queued towards the
    /// peer (a large put, a flush behind many `put_nbi`), keep every wait
    /// alive. Operations a transport carries natively (RDMA writes and
    /// reads, `sm` copies) have their own completions and are not
    /// concerned. Default 5 s, the transports' default peer timeout; raise
    /// it where a peer may take longer than that to answer what it
    /// received. At least 1 ms. Env: `BTL_ANSWER_TIMEOUT_MS`.
    pub answer_timeout: Duration,
    /// Settings of the `udp` transport (`BTL_UDP_*`).
    pub udp: crate::UdpConfig,
    /// Settings of the `rdma` transport (`BTL_RDMA_*`; read in every
    /// build, used where it is built with the `rdma` feature).
    pub rdma: crate::RdmaConfig,
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
            liveness: Liveness::Thread,
            copy: CopyMode::Auto,
            sm: Default::default(),
            recv_budget: 32 << 20,
            recv_total_budget: 1 << 30,
            boot_timeout: Duration::from_secs(30),
            close_timeout: Duration::from_secs(10),
            answer_timeout: Duration::from_secs(5),
            udp: Default::default(),
            rdma: Default::default(),
            transports: Vec::new(),
        }
    }
}

use crate::sys::env::parse;

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
        if let Some(v) = get("BTL_LIVENESS") {
            c.liveness = v.parse()?;
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
        if let Some(v) = us("BTL_ANSWER_TIMEOUT_MS")? {
            c.answer_timeout = Duration::from_millis(v.max(1));
        }
        for (k, f) in [
            ("BTL_RECV_BUDGET", &mut c.recv_budget),
            ("BTL_RECV_TOTAL_BUDGET", &mut c.recv_total_budget),
        ] {
            if let Some(v) = get(k) {
                *f = parse(k, &v)?;
            }
        }
        if let Some(v) = get("BTL_TRANSPORTS") {
            c.transports = Self::parse_transports(&v);
        }
        c.sm.read(&get)?;
        c.udp.read(&get)?;
        c.rdma.read(&get)?;
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
        self.sm.validate()?;
        self.udp.validate()?;
        self.rdma.validate()?;
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
            assert_eq!(c.udp.addr, Some(want.parse().unwrap()), "{v}");
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
        assert!(Config::default().udp.bundle);
        for (v, want) in [("1", true), ("on", true), ("0", false), (" OFF ", false)] {
            assert_eq!(with(v).unwrap().udp.bundle, want, "{v}");
        }
        let e = with("maybe").unwrap_err().to_string();
        assert!(e.contains("BTL_UDP_BUNDLE"), "{e}");
    }

    #[test]
    fn udp_gso_switch() {
        let with = |v: &str| Config::from_lookup(|k| (k == "BTL_UDP_GSO").then(|| v.to_string()));
        assert!(Config::default().udp.gso);
        for (v, want) in [("1", true), ("yes", true), ("0", false), ("false", false)] {
            assert_eq!(with(v).unwrap().udp.gso, want, "{v}");
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

    #[test]
    fn liveness_names() {
        let with = |v: &str| Config::from_lookup(|k| (k == "BTL_LIVENESS").then(|| v.to_string()));
        assert_eq!(Config::default().liveness, Liveness::Thread);
        for (v, want) in [("thread", Liveness::Thread), (" Inline ", Liveness::Inline)] {
            assert_eq!(with(v).unwrap().liveness, want, "{v}");
        }
        let e = with("none").unwrap_err().to_string();
        assert!(e.contains("thread or inline"), "{e}");
    }
}

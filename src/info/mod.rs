//! What this host offers async-btl: which transports work here and why
//! the others do not, whether single-copy (CMA) access between processes
//! is allowed, and the limits in force. `btl-info` (in the `btl-tools`
//! package) prints it, with the CPU topology beside it.
//!
//! Everything here only looks: it creates and removes one small file in the
//! shared-memory directory and binds (and closes) one UDP socket, nothing
//! more. Every item is serialisable, so a report prints as JSON as it is.

use serde::Serialize;

use crate::config::{Config, ProgressMode};

/// What this host offers: everything [`report`] finds.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// This crate's version.
    pub version: String,
    /// The host's name.
    pub host: String,
    /// Every transport this version knows, built or not.
    pub transports: Vec<TransportInfo>,
    /// Whether single-copy access to a sibling process's memory is allowed.
    pub cma: Check,
    /// Which transport would carry messages and one-sided operations to
    /// each kind of peer, given what is usable here and `BTL_TRANSPORTS`.
    pub routes: Vec<RouteInfo>,
    /// The limits the `BTL_*` environment gives (defaults where it is invalid).
    pub limits: Limits,
    /// Why the `BTL_*` environment is invalid, if it is: a job would fail to start.
    pub config_error: Option<String>,
}

/// One transport on this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TransportInfo {
    /// Its name, as `BTL_TRANSPORTS` spells it.
    pub name: String,
    /// Whether this build contains it.
    pub built: bool,
    /// Whether a job on this host can use it: built and the host check passed.
    pub usable: bool,
    /// What the host check found, or why it cannot be used.
    pub detail: String,
}

/// The route a job would take to one kind of peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RouteInfo {
    /// The kind of peer: `this rank`, `same node` or `other node`.
    pub peer: String,
    /// The transport that carries messages, if any reaches it.
    pub messages: Option<String>,
    /// The transport that carries one-sided operations on host memory
    /// (the messages' one unless another carries them natively; `None`
    /// when nothing reaches it).
    pub one_sided: Option<String>,
    /// The transport that carries put and get between device memory
    /// (`smcuda`: one GPU copy), if a usable one reaches it; `None`: such
    /// operations take the host-staged path over `one_sided`.
    pub device_memory: Option<String>,
}

/// Routes per kind of peer, as a fabric opened with `config` here would
/// pick them: the first usable, allowed transport in preference order
/// that reaches that kind of peer (for one-sided operations, the first
/// that carries them natively, else the messages' one). Whether a
/// transport reaches a given peer is only known with the peer's address;
/// this is the choice for a peer it does reach.
pub fn routes(config: &Config) -> Vec<RouteInfo> {
    use crate::transport::registry::Reach;
    let usable: Vec<_> = crate::transport::registry::entries()
        .into_iter()
        .filter(|e| e.not_built.is_none() && (e.implicit || config.allows(e.name)))
        .filter(|e| !cfg!(test) || e.name != "double")
        .filter(|e| (e.probe)().is_ok())
        .collect();
    [
        ("this rank", Reach::ThisRank),
        ("same node", Reach::Node),
        ("other node", Reach::Network),
    ]
    .into_iter()
    .map(|(peer, class)| {
        let reach: Vec<_> = usable.iter().filter(|e| e.reach.covers(class)).collect();
        let messages = reach
            .iter()
            .find(|e| e.messages)
            .map(|e| e.name.to_string());
        let native = reach
            .iter()
            .find(|e| e.one_sided)
            .map(|e| e.name.to_string());
        let device_memory = reach
            .iter()
            .find(|e| e.device_memory)
            .map(|e| e.name.to_string());
        RouteInfo {
            peer: peer.to_string(),
            one_sided: native.or_else(|| messages.clone()),
            messages,
            device_memory,
        }
    })
    .collect()
}

/// The outcome of one host check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Whether it passed.
    pub ok: bool,
    /// What was found, or what to do about it.
    pub detail: String,
}

/// The limits in force, from a [`Config`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Limits {
    /// Progress policy: `busy`, `adaptive` or `interrupt`.
    pub progress: String,
    /// Adaptive spin before parking, in microseconds.
    pub spin_us: u64,
    /// Peer liveness check period, in milliseconds.
    pub heartbeat_ms: u64,
    /// Shared memory: bytes per eager fragment, header included.
    pub sm_eager_size: usize,
    /// Shared memory: eager fragments per process.
    pub sm_eager_count: usize,
    /// Shared memory: bytes per max fragment, header included.
    pub sm_max_size: usize,
    /// Shared memory: max fragments per process.
    pub sm_max_count: usize,
    /// Bytes received but not consumed per tag before senders are held back.
    pub recv_budget: usize,
    /// The same for all tags together.
    pub recv_total_budget: usize,
    /// Shared memory: largest message that goes through a fast box.
    pub sm_fast_box_max: usize,
    /// Shared memory: sends (and put/get to registered buffers) of at least
    /// this many bytes use a single kernel copy where allowed.
    pub sm_single_copy_min: usize,
    /// Shared memory: sends from `sm_single_copy_min` up to (not
    /// including) this many bytes take single copy or fragments,
    /// whichever the sender measured cheaper lately (no larger than
    /// `sm_single_copy_min`: no choice, single copy). `BTL_SM_ADAPT_MAX`,
    /// ending no later than split copy's start and four doublings of
    /// `sm_single_copy_min`.
    pub sm_adapt_max: usize,
    /// Shared memory: sends of at least this many bytes are copied by both
    /// processes at once (split copy).
    pub sm_split_min: usize,
    /// UDP: whether small messages are gathered into bundles
    /// (`BTL_UDP_BUNDLE`).
    pub udp_bundle: bool,
    /// UDP: largest message (its framing included) gathered into bundles,
    /// where half a datagram allows it.
    pub udp_bundle_message_max: usize,
    /// UDP: largest bundle, where one datagram allows it.
    pub udp_bundle_max: usize,
    /// UDP: small messages in a row, and data segments in flight, before
    /// small messages are gathered.
    pub udp_bundle_after: usize,
    /// UDP: the longest a bundle waits for an acknowledgement, in
    /// microseconds.
    pub udp_bundle_wait_us: u64,
    /// UDP: whether segmentation offload and receive coalescing are
    /// allowed (`BTL_UDP_GSO`).
    pub udp_gso: bool,
    /// UDP: whether this kernel offers GSO (`UDP_SEGMENT`) and GRO
    /// (`UDP_GRO`) on UDP sockets.
    pub udp_gso_kernel: (bool, bool),
    /// UDP: what closes every datagram, `crc` or `mac` (`BTL_UDP_AUTH`).
    pub udp_auth: String,
    /// Address exchange limit at start-up, in milliseconds.
    pub boot_timeout_ms: u64,
    /// Limit on `Fabric::close`, in milliseconds.
    pub close_timeout_ms: u64,
    /// How long an emulated one-sided operation waits on a peer that
    /// answers nothing, in milliseconds (`BTL_ANSWER_TIMEOUT_MS`).
    pub answer_timeout_ms: u64,
    /// Transports allowed by `BTL_TRANSPORTS`, in order; empty means all.
    pub allowed_transports: Vec<String>,
}

impl From<&Config> for Limits {
    fn from(c: &Config) -> Self {
        let ms = |d: std::time::Duration| d.as_millis().try_into().unwrap_or(u64::MAX);
        Limits {
            progress: match c.progress {
                ProgressMode::BusyPoll => "busy",
                ProgressMode::Adaptive => "adaptive",
                ProgressMode::Interrupt => "interrupt",
            }
            .to_string(),
            spin_us: c.spin.as_micros().try_into().unwrap_or(u64::MAX),
            heartbeat_ms: ms(c.heartbeat),
            sm_eager_size: c.sm.eager_size,
            sm_eager_count: c.sm.eager_count,
            sm_max_size: c.sm.max_size,
            sm_max_count: c.sm.max_count,
            recv_budget: c.recv_budget,
            recv_total_budget: c.recv_total_budget,
            sm_fast_box_max: crate::sm::fbox::MAX_PAYLOAD,
            sm_single_copy_min: c.sm.cma_min,
            sm_adapt_max: crate::sm::adapt::band_end(c.sm.cma_min, c.sm.adapt_max, c.sm.split_min),
            sm_split_min: c.sm.split_min,
            udp_bundle: c.udp.bundle,
            udp_bundle_message_max: crate::udp::peer::BUNDLE_ITEM_MAX,
            udp_bundle_max: crate::udp::peer::BUNDLE_MAX,
            udp_bundle_after: crate::udp::peer::BUNDLE_AFTER,
            udp_bundle_wait_us: crate::udp::peer::BUNDLE_WAIT.as_micros() as u64,
            udp_gso: c.udp.gso,
            udp_gso_kernel: crate::udp::UdpTransport::kernel_offload(),
            udp_auth: c.udp.auth.name().to_string(),
            boot_timeout_ms: ms(c.boot_timeout),
            close_timeout_ms: ms(c.close_timeout),
            answer_timeout_ms: ms(c.answer_timeout),
            allowed_transports: c.transports.clone(),
        }
    }
}

/// Look at this host: transports, CMA, limits from the environment.
pub fn report() -> Report {
    let (config, config_error) = match Config::from_env() {
        Ok(c) => (c, None),
        Err(e) => (Config::default(), Some(e.to_string())),
    };
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    Report {
        version: env!("CARGO_PKG_VERSION").to_string(),
        host: host.trim().to_string(),
        transports: transports(),
        routes: routes(&config),
        cma: cma(),
        limits: Limits::from(&config),
        config_error,
    }
}

/// Every transport this version knows, in preference order, with the
/// outcome of its host check. A transport added to the crate shows up here
/// by name even before it has a check.
pub fn transports() -> Vec<TransportInfo> {
    crate::transport::registry::entries()
        .into_iter()
        .filter(|e| !cfg!(test) || e.name != "double")
        .map(|e| {
            let check = (e.probe)();
            let ok = check.is_ok();
            let detail = match (e.not_built, check) {
                (None, Ok(d) | Err(d)) => d,
                (Some(why), Ok(d) | Err(d)) => format!("{why}; {d}"),
            };
            TransportInfo {
                name: e.name.to_string(),
                built: e.not_built.is_none(),
                usable: e.not_built.is_none() && ok,
                detail,
            }
        })
        .collect()
}

/// Whether single-copy access (`process_vm_readv`/`writev`, CMA) between
/// sibling processes is allowed here.
pub fn cma() -> Check {
    match crate::sys::os::cma_status() {
        Ok(()) => Check {
            ok: true,
            detail: "process_vm_readv/writev between sibling processes is allowed".into(),
        },
        Err(why) => Check {
            ok: false,
            detail: format!("{why}; set it to 0 (sysctl) or run as root for single-copy transfers"),
        },
    }
}

/// The logical CPUs the calling thread may run on (`sched_getaffinity`),
/// ascending: the process's binding unless the thread was pinned itself.
///
/// # Errors
/// The OS error when the kernel refuses to say.
pub fn cpu_affinity() -> std::io::Result<Vec<u32>> {
    crate::sys::os::cpu_affinity()
}

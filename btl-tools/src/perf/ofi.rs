//! libfabric itself as a baseline (`--baseline ofi`): what the `rdma`
//! transport's provider does with nothing above it.
//!
//! Rank 0, once everything else is measured and the other rank has left,
//! compiles the embedded [`SOURCE`] with `cc -O2 ... -lfabric` into a
//! temporary directory and runs it once for all the points: the program
//! forks into two processes, pinned to the ranks' cores, which open the
//! provider with the hints the `rdma` transport uses, trade addresses
//! over a socketpair and run the same tests at the same sizes, with the
//! same iterations, warm-up and window as
//! [`Counts::plan`](super::plan::Counts::plan) gave async-btl. Its output
//! ("TEST SIZE VALUE" lines, [`parse_output`]) becomes samples named
//! `ofi`.
//!
//! The provider and address are the ones the run's `rdma` transport is
//! told to use (`BTL_RDMA_PROVIDER`, `BTL_RDMA_ADDR`), else `tcp;ofi_rxm`
//! bound to 127.0.0.1. It runs in rank 0's environment, so with the
//! `ofi_rxm` sizes the `rdma` transport set there (its eager frame, a
//! message and its header: 64 KiB over `tcp` by default): the same
//! provider settings for both, so that rxm sends the program's messages
//! eagerly up to the size the transport sends in one frame. Its progress
//! follows the run's progress mode:
//! Adaptive polls the completion queue for [`Config::spin`] after the last
//! completion, then parks on the queue's wait fd (`fi_trywait`, `poll`),
//! as the `rdma` transport's progress task does; BusyPoll never parks;
//! Interrupt parks at once.
//!
//! The tests, in libfabric's terms:
//! - `lat`: `fi_send`/`fi_recv` ping-pong, half the round trip;
//! - `bw`, `msg_rate`: a window of `fi_send`s into receives posted ahead,
//!   then a 4-byte send back;
//! - `put_lat`, `put_bw`: `fi_writemsg` with `FI_DELIVERY_COMPLETE` (the
//!   completion says the bytes are in the target's memory, as a `put`
//!   future's does), one at a time or a window then all completions;
//! - `get_lat`, `get_bw`: `fi_readmsg`, the same way;
//! - `atomic_lat`, `atomic_cswap_lat`: one `fi_fetch_atomicmsg` (`FI_SUM`)
//!   or `fi_compare_atomicmsg` (`FI_CSWAP`) on a `uint64_t` at a time;
//! - `atomic_rate`: a window of non-fetching `fi_atomicmsg` adds with
//!   `FI_DELIVERY_COMPLETE`, then all completions (the provider's
//!   `FI_ATOMIC`, which `ofi_rxm` emulates, is asked for only then).
//!
//! Whatever goes wrong (no `cc`, no libfabric headers, a provider that
//! does not open, a failed or stuck run, output that does not parse) is a
//! reason to skip, returned as text for the report's notes; never a
//! failure of the run.

use std::path::PathBuf;
use std::time::Duration;

use async_btl::{Config, ProgressMode};
use tokio::process::Command;

use super::plan::Plan;
use super::tool::{free_cores, parse_output, program_args, run_tool};
use super::Test;

/// The benchmark program, `btl-tools/baseline/ofi_pp.c`, built into
/// btl-perf so that an installed binary needs only a C compiler and
/// libfabric's headers.
pub const SOURCE: &str = include_str!("../../baseline/ofi_pp.c");

/// The provider used when the run names none.
pub const DEFAULT_PROVIDER: &str = "tcp;ofi_rxm";

/// The address bound when the run names none.
pub const DEFAULT_ADDR: &str = "127.0.0.1";

/// What btl-perf, starting its own two ranks on this host, tells their
/// `rdma` transport when the run names no address (`provider` and `addr`:
/// `BTL_RDMA_PROVIDER` and `BTL_RDMA_ADDR` as the run has them): the
/// provider and address the `ofi` baseline falls back to, so that the
/// transport and the baseline it is read against run on the same socket
/// provider over loopback. Left to itself, the transport would bind the
/// provider's pick of the host's addresses (an outside interface, whose
/// figures are not the baseline's). A named hardware provider, or a named
/// address, is left alone.
pub fn local_rank_env(
    provider: Option<&str>,
    addr: Option<&str>,
) -> Vec<(&'static str, &'static str)> {
    if addr.is_some() {
        return Vec::new();
    }
    match provider {
        None => vec![
            ("BTL_RDMA_PROVIDER", DEFAULT_PROVIDER),
            ("BTL_RDMA_ADDR", DEFAULT_ADDR),
        ],
        Some(p) if socket_provider(p) => vec![("BTL_RDMA_ADDR", DEFAULT_ADDR)],
        Some(_) => Vec::new(),
    }
}

/// Whether `provider` (as `fi_info` names it, layered ones with `;`) runs
/// over the host's sockets, so that loopback reaches it.
fn socket_provider(provider: &str) -> bool {
    matches!(
        provider.split(';').next().map(str::trim),
        Some("tcp" | "sockets" | "udp")
    )
}

/// The Debian package with libfabric's headers and library link.
const PACKAGE: &str = "libfabric-dev";

/// The tests the program implements.
pub fn supports(test: Test) -> bool {
    matches!(
        test,
        Test::Lat
            | Test::Bw
            | Test::MsgRate
            | Test::PutLat
            | Test::PutBw
            | Test::GetLat
            | Test::GetBw
            | Test::AtomicLat
            | Test::AtomicCswapLat
            | Test::AtomicRate
    )
}

/// The tests of [`supports`], by name, comma-separated.
pub fn supported_names() -> String {
    super::test_names(supports)
}

/// Where and how the program runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setup {
    /// The provider, as `fi_info` names it.
    pub provider: String,
    /// The address of this host it binds.
    pub addr: String,
    /// Microseconds of polling before a park; `None`: never park.
    pub spin_us: Option<u64>,
    /// The cores of its two processes (`None`: not pinned).
    pub cores: (Option<usize>, Option<usize>),
}

impl Setup {
    /// The provider and address `config`'s `rdma` transport is told to
    /// use (or the defaults), its progress mode, and `cores`.
    pub fn new(config: &Config, cores: (Option<usize>, Option<usize>)) -> Setup {
        let spin_us = match config.progress {
            ProgressMode::BusyPoll => None,
            ProgressMode::Adaptive => {
                Some(u64::try_from(config.spin.as_micros()).unwrap_or(u64::MAX))
            }
            ProgressMode::Interrupt => Some(0),
        };
        Setup {
            provider: config
                .rdma
                .provider
                .clone()
                .unwrap_or_else(|| DEFAULT_PROVIDER.to_string()),
            addr: config
                .rdma
                .addr
                .clone()
                .unwrap_or_else(|| DEFAULT_ADDR.to_string()),
            spin_us,
            cores,
        }
    }

    /// The program's options, before the points.
    pub fn args(&self) -> Vec<String> {
        let mut v = vec![
            "-p".to_string(),
            self.provider.clone(),
            "-a".to_string(),
            self.addr.clone(),
            "-s".to_string(),
            self.spin_us.map_or("-1".to_string(), |s| s.to_string()),
        ];
        if let (Some(a), Some(b)) = self.cores {
            v.push("-c".to_string());
            v.push(format!("{a},{b}"));
        }
        v
    }

    fn pinned(&self) -> bool {
        self.cores.0.is_some() || self.cores.1.is_some()
    }
}

/// The program's own description of what it opened (its first comment
/// line: libfabric version, provider, fabric, domain, address, progress).
pub fn description(output: &str) -> Option<String> {
    output
        .lines()
        .find_map(|l| l.trim().strip_prefix("# ofi_pp: libfabric"))
        .map(|rest| format!("libfabric{rest}"))
}

/// The program, compiled into a temporary directory that is removed when
/// this is dropped.
pub struct Program {
    dir: PathBuf,
    exe: PathBuf,
}

impl Drop for Program {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What one run of the program gave: a value per point, and what it says
/// it opened.
pub struct Measured {
    /// One value per point, in order.
    pub values: Vec<f64>,
    /// [`description`] of its output, when it printed one.
    pub description: Option<String>,
}

impl Program {
    /// Write [`SOURCE`] out and compile it with `cc -O2 ... -lfabric`,
    /// limited to `limit`.
    pub async fn build(limit: Duration) -> Result<Program, String> {
        let dir = std::env::temp_dir().join(format!(
            "btl-perf-ofi-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        // From here on, dropping `p` removes the directory.
        let p = Program {
            exe: dir.join("ofi_pp"),
            dir,
        };
        let src = p.dir.join("ofi_pp.c");
        std::fs::write(&src, SOURCE).map_err(|e| format!("cannot write {}: {e}", src.display()))?;
        let mut cc = Command::new("cc");
        cc.arg("-O2")
            .arg("-o")
            .arg(&p.exe)
            .arg(&src)
            .arg("-lfabric");
        let done = run_tool(cc, "cc", "gcc", limit).await?;
        if !done.ok {
            return Err(format!(
                "{} (it needs libfabric's headers and library: apt-get install {PACKAGE})",
                done.failure("cc")
            ));
        }
        Ok(p)
    }

    /// Measure `points` in one run of the program limited to `limit`.
    pub async fn measure(
        &self,
        setup: &Setup,
        points: &[(Test, usize, Plan)],
        limit: Duration,
    ) -> Result<Measured, String> {
        let mut cmd = Command::new(&self.exe);
        cmd.args(setup.args()).args(program_args(points));
        if setup.pinned() {
            // Rank 0 is pinned to one core, and children inherit that: the
            // program places its two processes itself.
            free_cores(&mut cmd);
        }
        let done = run_tool(cmd, "ofi_pp", PACKAGE, limit).await?;
        if !done.ok {
            return Err(done.failure("ofi_pp"));
        }
        let text = String::from_utf8_lossy(&done.stdout);
        let want: Vec<(Test, usize)> = points.iter().map(|(t, s, _)| (*t, *s)).collect();
        Ok(Measured {
            values: parse_output(&text, &want)?,
            description: description(&text),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_ranks_get_the_baselines_loopback_unless_told_otherwise() {
        let both = local_rank_env(None, None);
        assert_eq!(
            both,
            vec![
                ("BTL_RDMA_PROVIDER", DEFAULT_PROVIDER),
                ("BTL_RDMA_ADDR", DEFAULT_ADDR)
            ]
        );
        assert_eq!(
            local_rank_env(Some("tcp;ofi_rxm"), None),
            vec![("BTL_RDMA_ADDR", DEFAULT_ADDR)]
        );
        assert_eq!(
            local_rank_env(Some("sockets"), None),
            vec![("BTL_RDMA_ADDR", DEFAULT_ADDR)]
        );
        assert!(local_rank_env(Some("verbs;ofi_rxm"), None).is_empty());
        assert!(local_rank_env(None, Some("10.0.0.1")).is_empty());
        assert!(local_rank_env(Some("tcp;ofi_rxm"), Some("10.0.0.1")).is_empty());
    }

    #[test]
    fn setup_follows_the_rdma_settings_and_progress() {
        let mut c = Config::default();
        let d = Setup::new(&c, (Some(0), Some(1)));
        assert_eq!(
            d.args(),
            [
                "-p",
                "tcp;ofi_rxm",
                "-a",
                "127.0.0.1",
                "-s",
                "200",
                "-c",
                "0,1"
            ]
        );
        c.rdma.provider = Some("verbs;ofi_rxm".into());
        c.rdma.addr = Some("10.0.0.2".into());
        c.progress = ProgressMode::BusyPoll;
        let b = Setup::new(&c, (None, None));
        assert_eq!(
            b.args(),
            ["-p", "verbs;ofi_rxm", "-a", "10.0.0.2", "-s", "-1"]
        );
        c.progress = ProgressMode::Interrupt;
        assert_eq!(Setup::new(&c, (None, None)).spin_us, Some(0));
    }

    #[test]
    fn the_program_has_every_supported_test() {
        for t in Test::ALL {
            assert_eq!(
                supports(t),
                SOURCE.contains(&format!("\"{}\"", t.name())),
                "{t}"
            );
        }
        assert!(SOURCE.contains("FI_DELIVERY_COMPLETE") && SOURCE.contains("fi_readmsg"));
        assert!(SOURCE.contains("FI_WAIT_FD") && SOURCE.contains("fi_trywait"));
    }

    #[test]
    fn the_description_is_its_first_comment() {
        let out = "# ofi_pp: libfabric 1.17, provider tcp;ofi_rxm, fabric 127.0.0.1/32\n\
                   # ofi_pp: TEST SIZE VALUE\nlat 8 5.0\n";
        assert_eq!(
            description(out).as_deref(),
            Some("libfabric 1.17, provider tcp;ofi_rxm, fabric 127.0.0.1/32")
        );
        assert_eq!(description("lat 8 5.0\n"), None);
    }
}

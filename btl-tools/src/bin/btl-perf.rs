//! `btl-perf`: OSU-style point-to-point benchmarks of async-btl, with tokio
//! socket baselines measured in the same run by the same method.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use async_btl::bootstrap::JobInfo;
use async_btl::launch::LocalJob;
use async_btl::ProgressMode;
use btl_tools::perf::machine::Machine;
use btl_tools::perf::pin::{pin_current_thread, Pinning};
use btl_tools::perf::plan::Counts;
use btl_tools::perf::report::{Pick, Report};
use btl_tools::perf::session::{run, AtomicTarget, Settings};
use btl_tools::perf::{plot, Baseline, Test};
use clap::Parser;

const LONG_ABOUT: &str = "Point-to-point benchmarks of async-btl between two ranks, in the manner
of the OSU micro-benchmarks: ping-pong latency, windowed bandwidth (one way
and both ways), put/get latency and bandwidth, the 8-byte message rate, and
remote atomics on an 8-byte word of rank 1's region: fetch-and-add latency
(atomic_lat), compare-and-swap latency (atomic_cswap_lat) and the rate of
non-fetching adds completed by a flush per window (atomic_rate). The
atomics run at 8 B only; the report notes whether each test's atomics were
native (a CPU atomic on the mapped region, sm) or emulated (applied by
rank 1), and --atomic-target registered measures the emulated path.

The same tests run, in the same two processes on the same cores, over tokio
UnixStream, TcpStream (127.0.0.1) and UdpSocket (127.0.0.1) as baselines; the
table gives async-btl's value divided by each baseline's.

Open MPI 4.1 can be measured too, on request: `--baseline ompi` (its
shared-memory BTL, vader) and `--baseline ompi-tcp` (its TCP BTL on
loopback), for lat, bw, put_lat, put_bw and the three atomic tests
(MPI_Fetch_and_op, MPI_Compare_and_swap, MPI_Accumulate, each with
MPI_Win_flush) at the run's sizes and counts.
Rank 0 compiles a small MPI program with `mpicc` and runs it under
`mpirun -np 2 --bind-to core` after everything else; without mpicc or
mpirun (apt-get install openmpi-bin libopenmpi-dev), when mpirun fails,
or when btl-perf itself runs under mpirun, the report says why in a
`# note:` line and the run goes on.

So can UCX: `--baseline ucx` runs its own `ucx_perftest` (apt-get install
ucx-utils) over its shared-memory transports (UCX_TLS=sm,self), one server
and client pair per point on the ranks' cores, for lat, bw, put_bw, get_bw,
msg_rate, and the atomics (ucp_fadd, ucp_cswap, ucp_add). A test it cannot
run is a note; the others go on. `--baseline ucx-tcp` runs the same tests
over UCX's TCP transport on loopback (UCX_TLS=tcp, UCX_NET_DEVICES=lo).

And so can libfabric itself: `--baseline ofi` compiles a small C program
with `cc -O2 ... -lfabric` (apt-get install libfabric-dev) and runs it in
two processes on the ranks' cores, on the provider and address the rdma
transport is given (BTL_RDMA_PROVIDER, BTL_RDMA_ADDR; else tcp;ofi_rxm on
127.0.0.1, which btl-perf started alone also gives its two ranks' rdma
transport unless a hardware provider or an address is named), with the same progress (poll the completion queue, then park
on its wait fd), for lat and bw (fi_send/fi_recv), msg_rate, put_lat and
put_bw (fi_writemsg with FI_DELIVERY_COMPLETE), get_lat and get_bw
(fi_readmsg). Its figures are what the rdma transport's are compared with.

With the ranks pinned to two cores (the default), rank 0 also reads the
machine's own hop before and after each run: an 8-byte ping-pong between
two threads on the ranks' cores, in a child process (the rank keeps the
threads it had), no library in between. The report
gives it in a `# floor:` line and warns when it moved by more than 1.5x:
on a VM whose speed changes while it runs, such a run compares points
taken at different speeds.

Run it alone (it starts its own two ranks), or as two ranks under
`btl-run -n 2` or `mpirun -np 2`. Rank 0 prints the report.";

const EXAMPLES: &str = "Examples:
  btl-perf --test lat,bw --progress busy
  btl-perf --test bw --min-size 4K --max-size 4M --json > bw.json
  btl-run -n 2 -- btl-perf --test put_bw --baseline none
  btl-perf --test lat,bw --baseline ompi,ompi-tcp,unix --min-size 8 --max-size 1M
  btl-perf --transport sm --test lat,bw,put_bw --baseline ompi,ucx --repeat 3
  btl-perf --transport sm --test atomic_lat,atomic_cswap_lat,atomic_rate --baseline ucx,ompi
  BTL_RDMA_PROVIDER='tcp;ofi_rxm' BTL_RDMA_ADDR=127.0.0.1 btl-perf --compare rdma,udp \
      --test lat,bw,put_lat,put_bw,get_bw --baseline ofi,ucx-tcp --repeat 3 --pick median
  mpirun -np 2 btl-perf --test lat --plot lat.svg";

/// Command-line arguments.
#[derive(Debug, Parser)]
#[command(name = "btl-perf", version, about = "Point-to-point benchmarks of async-btl against tokio sockets.", long_about = LONG_ABOUT, after_help = EXAMPLES)]
struct Args {
    /// Tests to run, comma-separated: lat, bw, bibw, put_lat, put_bw,
    /// get_lat, get_bw, msg_rate, atomic_lat (fetch_add), atomic_cswap_lat
    /// (compare_swap), atomic_rate (atomic_add_nbi windows and a flush), or
    /// all.
    #[arg(long, value_name = "TESTS", default_value = "all", value_parser = tests)]
    test: std::vec::Vec<Test>,

    /// Transports async-btl may use (sets BTL_TRANSPORTS for the ranks):
    /// sm, udp, ...
    #[arg(long, value_name = "NAMES")]
    transport: Option<String>,

    /// Measure async-btl once per listed transport, each forced alone
    /// (e.g. `sm,udp`): one series per transport in the table and plot,
    /// all beside the same baselines. An entry may name a variant of a
    /// transport's settings: `udp:mac` and `udp:crc` (the datagram guard,
    /// BTL_UDP_AUTH), e.g. `--compare udp:mac,udp:crc`.
    #[arg(long, value_name = "NAMES", conflicts_with = "transport")]
    compare: Option<String>,

    /// Progress mode: busy, adaptive or interrupt (default: BTL_PROGRESS,
    /// else adaptive).
    #[arg(long, value_name = "MODE", value_parser = progress)]
    progress: Option<ProgressMode>,

    /// Smallest message size (bytes; K, M suffixes; rounded up to a power of two).
    #[arg(long, value_name = "BYTES", default_value = "1", value_parser = size)]
    min_size: usize,

    /// Largest message size.
    #[arg(long, value_name = "BYTES", default_value = "16M", value_parser = size)]
    max_size: usize,

    /// Exact message sizes instead of the powers of two from --min-size to
    /// --max-size, comma-separated (K, M suffixes), e.g. the edges of a
    /// protocol: `--sizes 48,49,16319,16320,16321`. Run in the order given.
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = size, conflicts_with_all = ["min_size", "max_size"])]
    sizes: Vec<usize>,

    /// Timed iterations per size up to 8 KiB (windowed tests time a tenth as
    /// many windows); fewer above, in proportion to the size. The default is
    /// osu_latency's: a point of small messages then lasts milliseconds, so
    /// a pause of the machine of some tens of microseconds (a timer, a
    /// hypervisor's exit) moves it by a percent, not by a tenth.
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    iters: u64,

    /// Untimed iterations first (scaled like --iters).
    #[arg(long, value_name = "N", default_value_t = 1000)]
    warmup: u64,

    /// Operations in flight per window in the bandwidth tests (shrunk so a
    /// window holds at most 16 MiB); msg_rate's stream is acknowledged only
    /// every 64 windows, as UCX's tag_bw is not at all until its end.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    window: u64,

    /// In put_bw and get_bw, start one put/get future per operation (each
    /// answered by the target) instead of put_nbi/get_nbi, whose window
    /// completes with one flush (MPI_Put and MPI_Win_flush, as OSU does)
    #[arg(long)]
    rma_futures: bool,

    /// Memory the atomic tests' words live in on rank 1: region
    /// (Fabric::alloc_region; mapped by a same-node peer, native atomics
    /// on sm) or registered (Fabric::register of a PageBuf; emulated, rank 1
    /// applies each atomic).
    #[arg(long, value_name = "KIND", default_value = "region")]
    atomic_target: AtomicTarget,

    /// Core placement: auto (rank i on core i), none, or a list like 0,1.
    #[arg(long, value_name = "CORES", default_value = "auto")]
    pin: Pinning,

    /// Baselines, comma-separated: unix, tcp, udp, ompi (Open MPI, shared
    /// memory), ompi-tcp (Open MPI, TCP on loopback), ucx (UCX's
    /// ucx_perftest over shared memory), ucx-tcp (ucx_perftest over TCP on
    /// loopback), ofi (raw libfabric on the rdma transport's provider), or
    /// none.
    #[arg(long, value_name = "LIST", default_value = "unix,tcp,udp", value_parser = baselines)]
    baseline: std::vec::Vec<Baseline>,

    /// With --baseline ofi: measure the libfabric program point by point,
    /// each point right after async-btl's (of the first series, under
    /// --compare), both ranks waiting at a barrier meanwhile, instead of
    /// all its points after the run. The pair then shares a phase of a
    /// machine whose speed drifts; each point costs a start of the
    /// program. Not under busy polling (its ranks would spin beside the
    /// program on its cores): the report notes it.
    #[arg(long)]
    interleave: bool,

    /// Print JSON instead of the table.
    #[arg(long, conflicts_with = "csv")]
    json: bool,

    /// Print CSV instead of the table.
    #[arg(long)]
    csv: bool,

    /// Also draw latency and bandwidth against size into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,

    /// Give up when one measurement takes longer than this (seconds).
    #[arg(long, value_name = "SECS", default_value_t = 120)]
    watchdog: u64,

    /// Run everything this many times and report, per test, series and
    /// size, the best run (lowest latency, highest bandwidth), with the
    /// ratios from those. Each run measures async-btl and then the
    /// baselines, so repeats interleave them in time: on a noisy machine
    /// this compares like with like far better than one run.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    repeat: u32,

    /// With --repeat: report each point's best run (`best`, the default)
    /// or its middle run (`median`: on a shared VM, one run of one series
    /// that catches a fast phase moves a best-of ratio more than the code
    /// does). With `median` each ratio is the middle of the runs' own
    /// ratios, each pair taken in the same run.
    #[arg(long, value_name = "HOW", default_value = "best", value_parser = pick)]
    pick: Pick,
}

fn pick(s: &str) -> Result<Pick, String> {
    match s {
        "best" => Ok(Pick::Best),
        "median" => Ok(Pick::Median),
        other => Err(format!("unknown pick {other:?}: use best or median")),
    }
}

fn tests(s: &str) -> Result<Vec<Test>, String> {
    if s.trim() == "all" {
        return Ok(Test::ALL.to_vec());
    }
    s.split(',').map(str::parse).collect()
}

fn baselines(s: &str) -> Result<Vec<Baseline>, String> {
    match s.trim() {
        "none" | "" => Ok(Vec::new()),
        list => list.split(',').map(str::parse).collect(),
    }
}

fn progress(s: &str) -> Result<ProgressMode, String> {
    s.parse().map_err(|e: async_btl::Error| e.to_string())
}

fn size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 1usize << 10),
        Some((i, 'M' | 'm')) => (&t[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|n| *n >= 1)
        .ok_or_else(|| format!("{s:?} is not a size in bytes (like 64, 4K, 16M)"))
}

/// Environment variable by which a self-launching btl-perf tells rank 0
/// that the user's stdout is a terminal.
const TTY_VAR: &str = "BTL_PERF_TTY";

fn main() -> ExitCode {
    // Started by rank 0 to read the machine's floor apart from it.
    if let Some(code) = btl_tools::perf::floor::probe_main() {
        return code;
    }
    let args = Args::parse();
    if args.min_size > args.max_size {
        eprintln!("btl-perf: --min-size is above --max-size");
        return ExitCode::from(2);
    }
    match JobInfo::from_env() {
        Ok(None) => launch_self(&args),
        Ok(Some(job)) => as_rank(args, job),
        Err(e) => {
            eprintln!("btl-perf: {e}");
            ExitCode::from(1)
        }
    }
}

/// Started by hand: run ourselves as two ranks.
fn launch_self(args: &Args) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("btl-perf: cannot find my own executable: {e}");
            return ExitCode::from(1);
        }
    };
    let mut job = LocalJob::new(exe, 2)
        .args(std::env::args_os().skip(1))
        .prefix_output(false);
    if let Some(t) = &args.transport {
        job = job.env("BTL_TRANSPORTS", t);
    }
    // Both ranks are on this host: the rdma transport runs where the ofi
    // baseline does, unless the run says where.
    let set = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let (prov, addr) = (set("BTL_RDMA_PROVIDER"), set("BTL_RDMA_ADDR"));
    for (k, v) in btl_tools::perf::ofi::local_rank_env(prov.as_deref(), addr.as_deref()) {
        job = job.env(k, v);
    }
    if std::io::stdout().is_terminal() {
        job = job.env(TTY_VAR, "1");
    }
    let Some(rt) = runtime() else {
        return ExitCode::from(1);
    };
    match rt.block_on(job.run()) {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("btl-perf: {e}");
            ExitCode::from(1)
        }
    }
}

fn command_line() -> String {
    let parts: Vec<String> = std::iter::once(OsString::from("btl-perf"))
        .chain(std::env::args_os().skip(1))
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    parts.join(" ")
}

fn as_rank(args: Args, job: JobInfo) -> ExitCode {
    let machine = Machine::probe();
    let core = args.pin.core_for(job.local_rank, machine.usable_cores);
    if let Some(c) = core {
        if let Err(e) = pin_current_thread(c) {
            eprintln!("btl-perf: rank {}: {e} (use --pin none)", job.rank);
            return ExitCode::from(1);
        }
    }
    let settings = Settings {
        tests: args.test.clone(),
        transport: args.transport.clone(),
        compare: args
            .compare
            .as_deref()
            .map(async_btl::Config::parse_transports)
            .unwrap_or_default(),
        progress: args.progress,
        min_size: args.sizes.iter().copied().min().unwrap_or(args.min_size),
        max_size: args.sizes.iter().copied().max().unwrap_or(args.max_size),
        sizes: args.sizes.clone(),
        counts: Counts {
            iters: args.iters,
            warmup: args.warmup,
            window: args.window,
        },
        pin: args.pin.clone(),
        cores: (
            args.pin.core_for(0, machine.usable_cores),
            args.pin.core_for(1, machine.usable_cores),
        ),
        baselines: args.baseline.clone(),
        watchdog: Duration::from_secs(args.watchdog.max(1)),
        command: command_line(),
        rma_futures: args.rma_futures,
        interleave: args.interleave,
        atomic_target: args.atomic_target,
    };
    let rank = job.rank;
    let bar = (rank == 0)
        .then(|| progress_bar(settings.steps() * u64::from(args.repeat)))
        .flatten();
    let Some(rt) = runtime() else {
        return ExitCode::from(1);
    };
    let mut tick = |what: &str| {
        if let Some(b) = &bar {
            b.set_message(what.to_string());
            b.inc(1);
        }
    };
    let mut reports = Vec::new();
    for _ in 0..args.repeat {
        match rt.block_on(run(&settings, job.clone(), core, &mut tick)) {
            Ok(Some(r)) => reports.push(r),
            Ok(None) => {}
            Err(e) => {
                if let Some(b) = &bar {
                    b.finish_and_clear();
                }
                eprintln!("btl-perf: rank {rank}: {e}");
                return ExitCode::from(1);
            }
        }
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let Some(report) = Report::combine(reports, args.pick) else {
        return ExitCode::SUCCESS;
    };
    let text = if args.json {
        report.json() + "\n"
    } else if args.csv {
        report.csv()
    } else {
        report.table()
    };
    print!("{text}");
    if let Some(path) = &args.plot {
        if let Err(e) = plot::write_svg(&report, path) {
            eprintln!("btl-perf: {e}");
            return ExitCode::from(1);
        }
        eprintln!("btl-perf: plot written to {}", path.display());
    }
    ExitCode::SUCCESS
}

/// A progress bar when the user's stdout is a terminal: ours, or (when we
/// were started by a self-launching btl-perf, whose output forwarding is by
/// lines) the controlling terminal directly.
fn progress_bar(steps: u64) -> Option<indicatif::ProgressBar> {
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    let target = if std::io::stdout().is_terminal() && std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else if std::env::var_os(TTY_VAR).is_some() {
        let tty = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/tty")
            .ok()?;
        let out = tty.try_clone().ok()?;
        ProgressDrawTarget::term(console::Term::read_write_pair(tty, out), 10)
    } else {
        return None;
    };
    let bar = ProgressBar::with_draw_target(Some(steps), target);
    if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {wide_msg}") {
        bar.set_style(style);
    }
    Some(bar)
}

/// The one-thread tokio runtime each rank measures on (`None`, said why, if
/// it cannot start).
fn runtime() -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => Some(rt),
        Err(e) => {
            eprintln!("btl-perf: cannot start a runtime: {e}");
            None
        }
    }
}

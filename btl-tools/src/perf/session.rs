//! One rank's whole run: open the fabric, connect the socket baselines,
//! measure async-btl, close the fabric, measure the socket baselines over
//! the same two processes, then (rank 0, while rank 1, done, exits) the
//! Open MPI baselines under their own `mpirun`, the UCX baselines with
//! their own `ucx_perftest` and the libfabric baseline with its own C
//! program, and build the [`Report`].
//!
//! The baselines run after the fabric is closed, so that a busy-polling
//! progress task never competes with them for the core; Open MPI, UCX and
//! libfabric run last, when the other rank has nothing left to do. Under
//! `--interleave` the libfabric program runs instead point by point inside
//! the first series, while both ranks wait with their progress parked.

use std::collections::BTreeMap;
use std::time::Duration;

use super::machine::{utc_now, Floor, Header, Machine};
use super::method::{atomic_timed, on_wire, rma_timed, RmaSide, ATOMIC_TARGET};
use super::pin::Pinning;
use super::plan::Counts;
use super::report::Report;
use super::wire::{connect_baselines, BtlWire, UDP_CHUNK};
use super::{btl_label, Baseline, Sample, Test};
use super::{ofi, ompi, ucx};
use async_btl::bootstrap::JobInfo;
use async_btl::{
    Config, CopyChoice, Error, Fabric, PageBuf, ProgressMode, RemoteKey, Result, Stats,
};

/// Tag of benchmark messages.
const TAG_DATA: u64 = 0x7065_7266_0001;
/// Tag of set-up messages (remote keys).
const TAG_CTRL: u64 = 0x7065_7266_0002;
/// Tag of the baselines' address exchange.
const TAG_SETUP: u64 = 0x7065_7266_0003;

/// What to run (the command line, parsed).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Tests, in order.
    pub tests: Vec<Test>,
    /// `BTL_TRANSPORTS` for the ranks (`None`: the environment's, or all).
    pub transport: Option<String>,
    /// Transports to measure one after the other, each forced alone (empty:
    /// one run under `transport`).
    pub compare: Vec<String>,
    /// Progress mode (`None`: the environment's, or the default).
    pub progress: Option<ProgressMode>,
    /// Smallest message size.
    pub min_size: usize,
    /// Largest message size.
    pub max_size: usize,
    /// Exact sizes to run at, in this order, instead of the powers of two
    /// from `min_size` to `max_size` (empty: those powers of two).
    pub sizes: Vec<usize>,
    /// Iterations, warm-up and window before scaling per size.
    pub counts: Counts,
    /// Core placement.
    pub pin: Pinning,
    /// The cores of local ranks 0 and 1 under `pin` (`None`: not pinned),
    /// where rank 0 places the two processes of an external baseline.
    pub cores: (Option<usize>, Option<usize>),
    /// Baselines to measure.
    pub baselines: Vec<Baseline>,
    /// Longest one measurement may take before the run is abandoned.
    pub watchdog: Duration,
    /// The command line, for the report.
    pub command: String,
    /// `put_bw`/`get_bw` with one future per operation (see `RmaSide`).
    pub rma_futures: bool,
    /// What memory the atomic tests' words live in on rank 1.
    pub atomic_target: AtomicTarget,
    /// Measure the `ofi` baseline point by point, each right after
    /// async-btl's same point (rank 0 runs the program between points
    /// while both ranks wait), instead of after the run.
    pub interleave: bool,
}

/// The memory rank 1 offers the atomic tests (`--atomic-target`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AtomicTarget {
    /// A region from `Fabric::alloc_region`: same-node peers map it, so
    /// over `sm` an atomic is one hardware instruction on the mapping.
    #[default]
    Region,
    /// A `PageBuf` passed to `Fabric::register`: private to rank 1, so
    /// every atomic is a request that rank 1 applies (emulated).
    Registered,
}

impl AtomicTarget {
    /// The name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            AtomicTarget::Region => "region",
            AtomicTarget::Registered => "registered",
        }
    }
}

impl std::fmt::Display for AtomicTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for AtomicTarget {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "region" => Ok(AtomicTarget::Region),
            "registered" => Ok(AtomicTarget::Registered),
            other => Err(format!(
                "unknown atomic target {other:?}; choose region (Fabric::alloc_region) or registered (Fabric::register of a PageBuf)"
            )),
        }
    }
}

impl Settings {
    /// Number of measurements one rank makes (for a progress bar).
    pub fn steps(&self) -> u64 {
        let per = |t: &Test| self.sizes_of(*t).len() as u64;
        let btl: u64 = self.tests.iter().map(per).sum::<u64>() * self.compare.len().max(1) as u64;
        let base: u64 = self
            .baselines
            .iter()
            .map(|b| {
                self.tests
                    .iter()
                    .filter(|t| b.measures(**t))
                    .map(per)
                    .sum::<u64>()
            })
            .sum();
        btl + base
    }

    /// The fabric's configuration: the environment's, with our overrides.
    pub fn config(&self) -> Result<Config> {
        let mut c = Config::from_env()?;
        if let Some(p) = self.progress {
            c.progress = p;
        }
        if let Some(t) = &self.transport {
            c.transports = Config::parse_transports(t);
        }
        c.validate()?;
        Ok(c)
    }

    /// The sizes `test` runs at: the listed ones, or the powers of two in
    /// range (`msg_rate` and the atomics: 8 bytes either way).
    pub fn sizes_of(&self, test: Test) -> Vec<usize> {
        if self.sizes.is_empty() || test.fixed_size().is_some() {
            test.sizes(self.min_size, self.max_size)
        } else {
            self.sizes.clone()
        }
    }

    fn max_len(&self) -> usize {
        // Room for the socket wires' atomic requests too.
        self.max_size
            .max(super::method::REQUEST)
            .max(super::method::CSWAP_REQUEST)
    }
}

/// Run one rank. `tick` is called after each measurement with a label.
/// Rank 0 returns the report; rank 1 returns `None`.
pub async fn run(
    s: &Settings,
    job: JobInfo,
    core: Option<usize>,
    tick: &mut dyn FnMut(&str),
) -> Result<Option<Report>> {
    if job.size != 2 {
        return Err(Error::Config(format!(
            "btl-perf runs on exactly 2 ranks; this job has {} (use btl-run -n 2 or mpirun -np 2)",
            job.size
        )));
    }
    let launcher = format!("{:?}", job.launcher);
    let config = s.config()?;
    // Before rank 1 has anything to do but wait for the bootstrap.
    let floor_cores = floor_cores(s, &job);
    let floor_before = floor_cores.and_then(super::floor::best_floor_apart);
    // One async-btl run per compared transport (or one under `transport`),
    // with its label.
    let runs: Vec<(Config, Option<String>)> = if s.compare.is_empty() {
        vec![(config.clone(), None)]
    } else {
        s.compare
            .iter()
            .map(|t| variant(&config, t).map(|c| (c, Some(t.clone()))))
            .collect::<Result<_>>()?
    };
    let mut sockets = Vec::new();
    let mut samples = Vec::new();
    let mut names = Vec::new();
    let mut atomic_notes = Vec::new();
    // The libfabric baseline beside the first series, point by point
    // (decided alike on both ranks: they meet before each point then).
    let interleave = interleaves(s, &config);
    let mut paired = None;
    if interleave && job.rank == 0 {
        paired = Some(Paired::new(s, &config).await);
    }
    // The bulk copy routine: the first fabric of the process chooses it.
    let mut copy = None;
    for (i, (cfg, label)) in runs.into_iter().enumerate() {
        let fabric = Fabric::from_job(job.clone(), cfg).await?;
        copy.get_or_insert(fabric.copy_routine());
        if i == 0 {
            let socket: Vec<Baseline> = s
                .baselines
                .iter()
                .copied()
                .filter(|b| !b.is_external())
                .collect();
            sockets = connect_baselines(&fabric, TAG_SETUP, &socket, s.max_len()).await?;
        }
        let transport = fabric.transport_for(1 - fabric.rank()).unwrap_or("none");
        // A variant keeps its label (`udp:crc`) when its transport runs.
        let name = match label {
            Some(l) if l.split(':').next() == Some(transport) => l,
            _ => transport.to_string(),
        };
        let pair = (i == 0 && interleave).then_some(paired.as_mut());
        let paths = measure(s, fabric, &name, &mut samples, pair, tick).await?;
        names.push(name);
        atomic_notes.extend(paths);
    }
    let rank = job.rank;
    let transport = names.join(",");
    let guard = |what: String| {
        move |_| Error::Timeout {
            what,
            after: s.watchdog,
        }
    };
    for (b, w) in &mut sockets {
        for &test in s.tests.iter().filter(|t| b.measures(**t)) {
            for size in s.sizes_of(test) {
                let plan = s.counts.plan(test, size);
                let what = format!("{test} at {size} B over {}", b.name());
                let f = on_wire(w, rank, test, size, &plan);
                let v = tokio::time::timeout(s.watchdog, f)
                    .await
                    .map_err(guard(what.clone()))??;
                if let Some(value) = v {
                    samples.push(sample(test, b.name(), size, value, &plan));
                }
                tick(&what);
            }
        }
    }
    if rank != 0 {
        return Ok(None);
    }
    drop(sockets);
    let mut notes = measure_mpi(s, &mut samples, tick).await;
    for b in s.baselines.iter().copied().filter(|b| b.is_ucx()) {
        notes.extend(measure_ucx(s, b, &mut samples, tick).await);
    }
    match paired {
        Some(p) => notes.extend(p.notes(s)),
        None if s.baselines.contains(&Baseline::Ofi) => {
            if s.interleave && config.progress == ProgressMode::BusyPoll {
                notes.push(format!(
                    "{}: not interleaved (--interleave): under busy polling the ranks' progress never parks and would compete with the program for the cores; measured after the run",
                    Baseline::Ofi.name()
                ));
            }
            notes.extend(measure_ofi(s, &config, &mut samples, tick).await);
        }
        None => {}
    }
    let mut header = header(s, &config, &transport, &launcher, core, copy);
    header.notes.extend(atomic_notes);
    header.notes.extend(notes);
    // After everything, the external baselines included (rank 1 is done).
    if let Some(cores) = floor_cores {
        header.floors.push(Floor {
            before: floor_before,
            after: super::floor::best_floor_apart(cores),
        });
    }
    Ok(Some(Report::new(header, samples)))
}

/// The points `b` measures in this run, each with the plan async-btl had.
fn points_of(s: &Settings, b: Baseline) -> Vec<(Test, usize, super::plan::Plan)> {
    s.tests
        .iter()
        .filter(|t| b.measures(**t))
        .flat_map(|&t| {
            s.sizes_of(t)
                .into_iter()
                .map(move |size| (t, size, s.counts.plan(t, size)))
        })
        .collect()
}

/// Rank 0: measure the UCX baseline `b`, adding its samples; returns the
/// notes for the report: what ran, and why a test (or all of it) was
/// skipped.
async fn measure_ucx(
    s: &Settings,
    b: Baseline,
    samples: &mut Vec<Sample>,
    tick: &mut dyn FnMut(&str),
) -> Vec<String> {
    let name = b.name();
    let only = ucx::supported_names();
    let points = points_of(s, b);
    if points.is_empty() {
        return vec![format!("{name} skipped: it measures {only} only")];
    }
    let results = ucx::measure(b, &points, s.cores, s.watchdog, tick).await;
    let mut failed: Vec<(Test, String)> = Vec::new();
    for (&(test, size, plan), r) in points.iter().zip(results) {
        match r {
            Ok(value) => samples.push(sample(test, name, size, value, &plan)),
            Err(why) => {
                if !failed.iter().any(|(t, _)| *t == test) {
                    failed.push((test, why));
                }
            }
        }
    }
    let measured = samples.iter().any(|x| x.wire == name);
    if !measured {
        // Nothing ran: one reason (the first) for all of it.
        let why = failed.into_iter().next().map_or_else(String::new, |f| f.1);
        return vec![format!("{name} skipped: {why}")];
    }
    let env: Vec<String> = ucx::env(b)
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let mut notes = vec![format!(
        "{name}: {}, ucx_perftest {} (a server and a client per point, same sizes and counts, operations in flight as UCX chooses; {only} only)",
        ucx::version(s.watchdog).await,
        env.join(" ")
    )];
    if samples.iter().any(|x| x.wire == name && x.test == Test::Bw) {
        notes.push(format!(
            "{name}: its bw (tag_bw) streams with no answer until its end, where async-btl's and Open MPI's bw wait for an answer to each window (a round trip per window); async-btl's msg_rate, answered every 64 windows, is the nearer twin of tag_bw"
        ));
    }
    for (test, why) in failed {
        notes.push(format!("{name}: no {test}: {why}"));
    }
    notes
}

/// Rank 0: measure the libfabric baseline on the provider `config`'s
/// `rdma` transport is told to use, adding its samples; returns the notes
/// for the report (what ran, or why it was skipped).
async fn measure_ofi(
    s: &Settings,
    config: &Config,
    samples: &mut Vec<Sample>,
    tick: &mut dyn FnMut(&str),
) -> Vec<String> {
    let name = Baseline::Ofi.name();
    let only = ofi::supported_names();
    let points = points_of(s, Baseline::Ofi);
    if points.is_empty() {
        return vec![format!("{name} skipped: it measures {only} only")];
    }
    let program = match ofi::Program::build(s.watchdog).await {
        Ok(p) => p,
        Err(why) => return vec![format!("{name} skipped: {why}")],
    };
    let setup = ofi::Setup::new(config, s.cores);
    // The run's own bound, once per point (as for the other series).
    let n = u32::try_from(points.len()).unwrap_or(u32::MAX);
    let limit = s.watchdog.saturating_mul(n.saturating_add(1));
    match program.measure(&setup, &points, limit).await {
        Ok(m) => {
            for (&(test, size, plan), value) in points.iter().zip(m.values) {
                samples.push(sample(test, name, size, value, &plan));
                tick(&format!("{test} at {size} B over {name}"));
            }
            let what = m
                .description
                .unwrap_or_else(|| format!("provider {}, bound to {}", setup.provider, setup.addr));
            vec![format!(
                "{name}: {what}; ofi_pp in its own two processes, after the others, same sizes and counts ({only} only; writes with FI_DELIVERY_COMPLETE)"
            )]
        }
        Err(why) => vec![format!("{name} skipped: {why}")],
    }
}

/// Whether the `ofi` baseline runs point by point inside the first series
/// (see [`Paired`]): asked for, with points to measure, and with progress
/// that parks (busy-polling ranks would compete with the program's two
/// processes for their cores).
fn interleaves(s: &Settings, config: &Config) -> bool {
    s.interleave
        && s.baselines.contains(&Baseline::Ofi)
        && !points_of(s, Baseline::Ofi).is_empty()
        && config.progress != ProgressMode::BusyPoll
}

/// Rank 0's libfabric baseline under `--interleave`: the `ofi` program
/// started for one point at a time, right after async-btl's first series
/// measured that point, while both ranks wait (rank 1 at the barrier the
/// ranks pass before each point of that series, outside its watchdog;
/// both with their progress parked; the program's two processes take the
/// ranks' cores). A pair is then measured within a second or two of each
/// other, in the same phase of a machine whose speed drifts, rather than
/// minutes apart. It costs a start of the program per point; after a
/// point fails, the rest are not tried.
struct Paired {
    /// The compiled program and its setup, or why there is none.
    program: std::result::Result<(ofi::Program, ofi::Setup), String>,
    /// What the program said of itself, once.
    description: Option<String>,
    /// Points measured.
    measured: usize,
    /// The first failure of a point, with the point.
    failed: Option<String>,
}

impl Paired {
    async fn new(s: &Settings, config: &Config) -> Paired {
        let program = ofi::Program::build(s.watchdog)
            .await
            .map(|p| (p, ofi::Setup::new(config, s.cores)));
        Paired {
            program,
            description: None,
            measured: 0,
            failed: None,
        }
    }

    /// Measure `test` at `size` with `plan`, if the program runs it.
    async fn point(
        &mut self,
        s: &Settings,
        (test, size, plan): (Test, usize, super::plan::Plan),
        samples: &mut Vec<Sample>,
        tick: &mut dyn FnMut(&str),
    ) {
        if !Baseline::Ofi.measures(test) {
            return;
        }
        let name = Baseline::Ofi.name();
        let (Ok((program, setup)), None) = (&self.program, &self.failed) else {
            tick(&format!("{test} at {size} B over {name}"));
            return;
        };
        match program
            .measure(setup, &[(test, size, plan)], s.watchdog)
            .await
        {
            Ok(m) => {
                if let Some(&value) = m.values.first() {
                    samples.push(sample(test, name, size, value, &plan));
                    self.measured += 1;
                }
                if self.description.is_none() {
                    self.description = m.description;
                }
            }
            Err(why) => {
                self.failed
                    .get_or_insert_with(|| format!("{test} at {size} B: {why}"));
            }
        }
        tick(&format!("{test} at {size} B over {name}"));
    }

    /// The report's notes: what ran, and what could not.
    fn notes(self, s: &Settings) -> Vec<String> {
        let name = Baseline::Ofi.name();
        let only = ofi::supported_names();
        let setup = match self.program {
            Ok((_, setup)) => setup,
            Err(why) => return vec![format!("{name} skipped: {why}")],
        };
        let mut notes = Vec::new();
        if self.measured > 0 {
            let what = self
                .description
                .unwrap_or_else(|| format!("provider {}, bound to {}", setup.provider, setup.addr));
            let first = s
                .compare
                .first()
                .map_or(String::new(), |t| format!(" ({t})"));
            notes.push(format!(
                "{name}: {what}; ofi_pp point by point (--interleave): its own two processes started for each point right after async-btl's first series{first} measured it, same sizes and counts ({only} only; writes with FI_DELIVERY_COMPLETE)"
            ));
        }
        match (self.failed, self.measured) {
            (Some(why), 0) => notes.push(format!("{name} skipped: {why}")),
            (Some(why), _) => notes.push(format!(
                "{name}: measured up to a failure, the rest not tried: {why}"
            )),
            (None, _) => {}
        }
        notes
    }
}

/// Rank 0: measure the Open MPI baselines asked for, adding their samples;
/// returns the report notes (what ran, or why it was skipped).
async fn measure_mpi(
    s: &Settings,
    samples: &mut Vec<Sample>,
    tick: &mut dyn FnMut(&str),
) -> Vec<String> {
    let wanted: Vec<Baseline> = s.baselines.iter().copied().filter(|b| b.is_mpi()).collect();
    if wanted.is_empty() {
        return Vec::new();
    }
    let skip_all = |why: String| {
        wanted
            .iter()
            .map(|b| format!("{} skipped: {why}", b.name()))
            .collect()
    };
    if let Some(var) = ompi::nested_launcher() {
        return skip_all(format!(
            "btl-perf runs under an MPI launcher ({var} is set) and does not start mpirun inside one; run it alone or under btl-run"
        ));
    }
    let program = match ompi::Program::build(s.watchdog).await {
        Ok(p) => p,
        Err(why) => return skip_all(why),
    };
    let only = ompi::supported_names();
    let mut notes = Vec::new();
    for b in wanted {
        let points = points_of(s, b);
        if points.is_empty() {
            notes.push(format!("{} skipped: it measures {only} only", b.name()));
            continue;
        }
        // The run's own bound, once per point (as for the other series).
        let n = u32::try_from(points.len()).unwrap_or(u32::MAX);
        let limit = s.watchdog.saturating_mul(n.saturating_add(1));
        match program.measure(b, &points, limit).await {
            Ok(values) => {
                for (&(test, size, plan), value) in points.iter().zip(values) {
                    samples.push(sample(test, b.name(), size, value, &plan));
                    tick(&format!("{test} at {size} B over {}", b.name()));
                }
                notes.push(format!(
                    "{}: {} in its own two processes, after the others, same sizes and counts ({only} only): mpirun {}",
                    b.name(),
                    program.version,
                    ompi::mpirun_args(b, false).join(" ")
                ));
            }
            Err(why) => notes.push(format!("{} skipped: {why}", b.name())),
        }
    }
    notes
}

fn is_rma(t: Test) -> bool {
    matches!(t, Test::PutLat | Test::PutBw | Test::GetLat | Test::GetBw)
}

fn sample(test: Test, wire: &str, size: usize, value: f64, plan: &super::plan::Plan) -> Sample {
    Sample {
        test,
        wire: wire.to_string(),
        size,
        value,
        unit: test.unit(),
        iters: plan.iters,
        warmup: plan.warmup,
        window: plan.window,
    }
}

fn header(
    s: &Settings,
    c: &Config,
    transport: &str,
    launcher: &str,
    core: Option<usize>,
    copy: Option<&CopyChoice>,
) -> Header {
    let mut m = BTreeMap::new();
    let mut set = |k: &str, v: String| {
        m.insert(k.to_string(), v);
    };
    let tests: Vec<&str> = s.tests.iter().map(|t| t.name()).collect();
    set("tests", tests.join(","));
    set(
        "transport",
        format!(
            "{transport} (BTL_TRANSPORTS={})",
            if c.transports.is_empty() {
                "any".to_string()
            } else {
                c.transports.join(",")
            }
        ),
    );
    set(
        "progress",
        format!("{:?} (spin {} us)", c.progress, c.spin.as_micros()),
    );
    set(
        "sizes",
        if s.sizes.is_empty() {
            format!("{}..{} B, powers of two", s.min_size, s.max_size)
        } else {
            let list: Vec<String> = s.sizes.iter().map(usize::to_string).collect();
            format!("{} B, as listed", list.join(", "))
        },
    );
    set(
        "counts",
        format!(
            "iters {}, warmup {}, window {} up to {} B (msg_rate: {}, one acknowledgement per window); fewer above (see each row)",
            s.counts.iters,
            s.counts.warmup,
            s.counts.window,
            super::plan::SMALL,
            s.counts
                .window
                .saturating_mul(super::plan::MSG_RATE_WINDOWS)
        ),
    );
    set(
        "pin",
        format!(
            "{} (rank 0 on {})",
            s.pin,
            core.map_or("no fixed core".into(), |c| format!("core {c}"))
        ),
    );
    let bases: Vec<&str> = s.baselines.iter().map(|b| b.name()).collect();
    set(
        "baselines",
        if bases.is_empty() {
            "none".into()
        } else {
            bases.join(",")
        },
    );
    set("launcher", launcher.to_string());
    set(
        "sm",
        format!(
            "eager {} B x {}, max {} B x {}",
            c.sm.eager_size, c.sm.eager_count, c.sm.max_size, c.sm.max_count
        ),
    );
    if let Some(c) = copy {
        set("copy", format!("bulk copies by {c}"));
    }
    set(
        "runtime",
        "tokio current-thread, one per rank process".into(),
    );
    set(
        "watchdog",
        format!("{} s per measurement", s.watchdog.as_secs()),
    );
    let mut notes = vec![
        "lat is half the round trip; put_lat/get_lat are whole operations (remote completion)"
            .into(),
        "baselines run in the same two processes, on the same cores, after the fabric is closed"
            .into(),
        "socket put/get: send data + wait for a 4 B ack / send an 8 B request + wait for the data"
            .into(),
    ];
    if s.tests
        .iter()
        .any(|t| matches!(t, Test::PutBw | Test::GetBw))
    {
        notes.push(if s.rma_futures {
            "async-btl put_bw/get_bw: a window of put/get futures, each answered, then flush (--rma-futures)".into()
        } else {
            "async-btl put_bw/get_bw: a window of put_nbi/get_nbi, then one flush (as MPI_Put/MPI_Get then MPI_Win_flush)".into()
        });
    }
    if s.tests.iter().any(|t| t.is_atomic()) {
        set(
            "atomics",
            format!(
                "8 B words of a {} B target on rank 1 made by {} (--atomic-target {})",
                ATOMIC_TARGET,
                match s.atomic_target {
                    AtomicTarget::Region => "Fabric::alloc_region",
                    AtomicTarget::Registered => "Fabric::register(PageBuf::zeroed)",
                },
                s.atomic_target
            ),
        );
        notes.push("atomic_lat: one fetch_add awaited at a time; atomic_cswap_lat: one compare_swap (always succeeding) at a time; atomic_rate: a window of atomic_add_nbi, then one flush; each answer checked".into());
        if s.baselines.iter().any(|b| !b.is_external()) {
            notes.push("socket atomics: send a 16 B request (24 B for cswap) + wait for the 8 B old value; atomic_rate: a window of 16 B requests + a 4 B ack".into());
        }
    }
    if s.baselines.contains(&Baseline::Udp) {
        notes.push(format!(
            "udp: messages above {UDP_CHUNK} B are cut into {UDP_CHUNK} B datagrams under a credit window; no bibw on udp"
        ));
    }
    Header {
        tool: format!("btl-perf {}", env!("CARGO_PKG_VERSION")),
        date: utc_now(),
        machine: Machine::probe(),
        command: s.command.clone(),
        settings: m,
        notes,
        floors: Vec::new(),
    }
}

/// The ranks' two cores when rank 0 reads the machine's own hop there
/// (both ranks on its node, pinned apart): rank 0 has a child process read
/// it while rank 1 waits or is done.
fn floor_cores(s: &Settings, job: &JobInfo) -> Option<(usize, usize)> {
    match s.cores {
        (Some(a), Some(b)) if a != b && job.rank == 0 && job.local_size == 2 && job.size == 2 => {
            Some((a, b))
        }
        _ => None,
    }
}

/// Measure async-btl over `fabric` (whose peer link uses `transport`), then
/// close the fabric. Rank 0 returns a note per atomic test run, saying
/// which path (native or emulated) carried its atomics.
/// The settings of one entry of `--compare`: a transport forced alone
/// (`udp`), or a transport and a variant of its settings (`udp:crc`,
/// `udp:mac`: the datagram guard, `BTL_UDP_AUTH`).
fn variant(base: &Config, entry: &str) -> Result<Config> {
    let mut c = base.clone();
    let (t, v) = match entry.split_once(':') {
        Some((t, v)) => (t, Some(v)),
        None => (entry, None),
    };
    c.transports = vec![t.to_string()];
    match (t, v) {
        (_, None) => {}
        ("udp", Some("crc")) => c.udp.auth = async_btl::udp::proto::Guard::Crc,
        ("udp", Some("mac")) => c.udp.auth = async_btl::udp::proto::Guard::Mac,
        (_, Some(v)) => {
            return Err(Error::Config(format!(
                "--compare {entry}: {t} has no variant {v:?} (known: udp:mac, udp:crc)"
            )))
        }
    }
    c.validate()?;
    Ok(c)
}

/// Measure every point over `fabric`. `paired`: `Some` in the series the
/// `ofi` program is interleaved with (both ranks; rank 0's holds the
/// program): the ranks then meet before each point, rank 1 waiting there
/// while rank 0 runs the program for the point before.
async fn measure(
    s: &Settings,
    fabric: Fabric,
    transport: &str,
    samples: &mut Vec<Sample>,
    mut paired: Option<Option<&mut Paired>>,
    tick: &mut dyn FnMut(&str),
) -> Result<Vec<String>> {
    let rank = fabric.rank();
    let peer = 1 - rank;
    let label = btl_label(transport);
    let max_len = s.max_len();
    let ep = fabric.endpoint(peer)?;
    let mut btl = BtlWire::new(ep.clone(), fabric.receiver(TAG_DATA)?, TAG_DATA, max_len);

    let rma = s.tests.iter().any(|t| is_rma(*t));
    let atomics = s.tests.iter().any(|t| t.is_atomic());
    let mut ctrl = fabric.receiver(TAG_CTRL)?;
    // Rank 1 owns the target regions; rank 0 learns their keys (in this
    // order, on one tag: the put/get region's, then the atomics').
    let mut targets = Vec::new();
    let (mut key, mut atomic_key, mut local) = (None, None, None);
    if rank == 1 {
        if rma {
            targets.push(fabric.alloc_region(max_len)?);
        }
        if atomics {
            targets.push(match s.atomic_target {
                AtomicTarget::Region => fabric.alloc_region(ATOMIC_TARGET)?,
                AtomicTarget::Registered => fabric.register(PageBuf::zeroed(ATOMIC_TARGET)),
            });
        }
        for r in &targets {
            ep.send(TAG_CTRL, r.remote_key().to_bytes()).await?;
        }
    } else {
        if rma {
            key = Some(RemoteKey::from_bytes(&ctrl.recv().await?.data)?);
            local = Some(fabric.register(vec![7u8; max_len]));
        }
        if atomics {
            atomic_key = Some(RemoteKey::from_bytes(&ctrl.recv().await?.data)?);
        }
    }

    let guard = |what: String| {
        move |_| Error::Timeout {
            what,
            after: s.watchdog,
        }
    };
    let mut paths = Vec::new();
    for &test in &s.tests {
        for size in s.sizes_of(test) {
            let plan = s.counts.plan(test, size);
            let what = format!("{test} at {size} B over {label}");
            if paired.is_some() {
                // Not under the watchdog: rank 0 may have run the program
                // for the point before.
                fabric.barrier().await?;
            }
            let v = if is_rma(test) {
                match (&key, &local) {
                    (Some(key), Some(local)) => {
                        let side = RmaSide {
                            ep: &ep,
                            local,
                            key,
                            futures: s.rma_futures,
                        };
                        let f = rma_timed(&side, test, size, &plan);
                        let v = tokio::time::timeout(s.watchdog, f)
                            .await
                            .map_err(guard(what.clone()))??;
                        Some(v)
                    }
                    _ => None, // rank 1: the target only serves
                }
            } else if test.is_atomic() {
                match &atomic_key {
                    Some(key) => {
                        let before = fabric.stats();
                        let f = atomic_timed(&ep, key, test, &plan);
                        let v = tokio::time::timeout(s.watchdog, f)
                            .await
                            .map_err(guard(what.clone()))??;
                        paths.push(atomic_path(
                            test,
                            &label,
                            s.atomic_target,
                            &before,
                            &fabric.stats(),
                        ));
                        Some(v)
                    }
                    None => None, // rank 1: the target only serves
                }
            } else {
                let f = on_wire(&mut btl, rank, test, size, &plan);
                tokio::time::timeout(s.watchdog, f)
                    .await
                    .map_err(guard(what.clone()))??
            };
            if let Some(value) = v {
                samples.push(sample(test, &label, size, value, &plan));
            }
            tick(&what);
            if let Some(Some(p)) = paired.as_mut() {
                p.point(s, (test, size, plan), samples, tick).await;
            }
        }
    }
    // Rank 1's regions must outlive rank 0's last put, get and atomic.
    fabric.barrier().await?;
    drop(targets);
    drop((btl, ctrl));
    fabric.close().await?;
    Ok(paths)
}

/// The note saying which path carried one atomic test's operations: the
/// change in the initiator's [`Stats::native_atomics`] and
/// [`Stats::emulated_atomics`] over the test (its warm-up and the reads
/// that check it included).
pub fn atomic_path(
    test: Test,
    label: &str,
    target: AtomicTarget,
    before: &Stats,
    after: &Stats,
) -> String {
    let native = after.native_atomics.saturating_sub(before.native_atomics);
    let emulated = after
        .emulated_atomics
        .saturating_sub(before.emulated_atomics);
    let path = match (native, emulated) {
        (_, 0) => "native",
        (0, _) => "emulated",
        _ => "mixed",
    };
    format!(
        "{test} over {label}: {path} atomics ({native} native, {emulated} emulated; target {})",
        match target {
            AtomicTarget::Region => "Fabric::alloc_region",
            AtomicTarget::Registered => "Fabric::register(PageBuf)",
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_paths_are_named_from_the_counters() {
        let before = Stats::default();
        let mut after = Stats::default();
        after.native_atomics = 1010;
        let n = atomic_path(
            Test::AtomicLat,
            "async-btl/sm",
            AtomicTarget::Region,
            &before,
            &after,
        );
        assert_eq!(
            n,
            "atomic_lat over async-btl/sm: native atomics (1010 native, 0 emulated; target Fabric::alloc_region)"
        );
        after.emulated_atomics = 5;
        let m = atomic_path(
            Test::AtomicRate,
            "async-btl/sm",
            AtomicTarget::Region,
            &before,
            &after,
        );
        assert!(
            m.contains(": mixed atomics (1010 native, 5 emulated"),
            "{m}"
        );
        let mut e = Stats::default();
        e.emulated_atomics = 7;
        let r = atomic_path(
            Test::AtomicCswapLat,
            "async-btl/udp",
            AtomicTarget::Registered,
            &before,
            &e,
        );
        assert!(
            r.contains("emulated atomics (0 native, 7 emulated; target Fabric::register(PageBuf))"),
            "{r}"
        );
    }

    #[test]
    fn atomic_targets_parse_by_name() {
        for t in [AtomicTarget::Region, AtomicTarget::Registered] {
            assert_eq!(t.name().parse::<AtomicTarget>(), Ok(t));
        }
        assert!("mapped".parse::<AtomicTarget>().is_err());
        assert_eq!(AtomicTarget::default(), AtomicTarget::Region);
    }
}

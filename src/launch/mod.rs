//! The local launcher behind `btl-run` (of the `btl-tools` package) and
//! [`run_self_if_unlaunched`]: start N ranks of a program on this node,
//! serve their rendezvous, forward their output, and stop them all as soon
//! as one fails.
//!
//! Each rank gets `BTL_RANK`, `BTL_SIZE`, `BTL_LOCAL_RANK`,
//! `BTL_LOCAL_SIZE`, `BTL_RENDEZVOUS=tcp:127.0.0.1:PORT`,
//! `BTL_RENDEZVOUS_HOST=launcher`, a random `BTL_JOB_KEY` and a fresh
//! `BTL_JOB_ID`; other launchers' rank variables (`OMPI_COMM_WORLD_*`,
//! `SLURM_PROCID`, `PMI_RANK`, `RANK`, ...) are removed from its
//! environment. The launcher binds the rendezvous port before starting any
//! rank, so there is no race for it.
//!
//! When every rank has exited, the launcher removes the shared-memory files
//! (`abtl.<pid>.*`) of its ranks that a signal killed before they could.
//!
//! Ranks run in their own process groups with stdin from `/dev/null`, and
//! die (SIGKILL, through `PR_SET_PDEATHSIG`) if the launcher's thread dies.
//!
//! Exit code: the first failing rank's code (128 + signal number when a
//! signal killed it); 124 when `timeout` expired first; 128 + signal number
//! when the launcher was interrupted first (SIGINT/SIGTERM, which it
//! forwards to the ranks; a second one sends SIGKILL); 0 when all succeed.

mod child;
mod output;
mod supervise;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::signal::unix::{signal, SignalKind};

use crate::bootstrap::{JobInfo, JobKey, RendezvousServer};
use crate::{Error, Result};

/// Default time between SIGTERM and SIGKILL when stopping ranks.
pub const DEFAULT_KILL_GRACE: Duration = Duration::from_secs(3);
/// Exit code when the job's timeout expired (as `timeout(1)`).
pub const TIMEOUT_EXIT_CODE: i32 = 124;
/// How long a round may wait for its last rank at the launcher's server.
const ROUND_LIMIT: Duration = Duration::from_secs(24 * 3600);
/// How long to drain output after the last rank exited.
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

/// A job of N ranks of one program on this node. See the [module docs](self).
#[derive(Debug, Clone)]
#[must_use]
pub struct LocalJob {
    program: OsString,
    args: Vec<OsString>,
    ranks: u32,
    prefix: bool,
    env: Vec<(OsString, OsString)>,
    timeout: Option<Duration>,
    grace: Duration,
    keep_going: bool,
}

impl LocalJob {
    /// `ranks` copies of `program` (found through `PATH` like a shell does).
    pub fn new(program: impl Into<OsString>, ranks: u32) -> Self {
        LocalJob {
            program: program.into(),
            args: Vec::new(),
            ranks,
            prefix: true,
            env: Vec::new(),
            timeout: None,
            grace: DEFAULT_KILL_GRACE,
            keep_going: false,
        }
    }

    /// Keep the other ranks running when one fails (like `mpirun`'s runs
    /// with fault tolerance): the survivors see the failure as
    /// `Error::PeerLost` on their pending operations and may carry on. The
    /// launcher still exits with the first failure's code once every rank
    /// has exited; a signal to the launcher or the job's timeout still
    /// stops them all. Off by default: the first failure stops the job.
    pub fn keep_going(mut self, on: bool) -> Self {
        self.keep_going = on;
        self
    }

    /// Arguments passed to every rank.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// An extra environment variable for every rank (the `BTL_*` variables
    /// the launcher sets take precedence).
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Prefix each output line with `[rank] ` (default on).
    pub fn prefix_output(mut self, on: bool) -> Self {
        self.prefix = on;
        self
    }

    /// Stop every rank after this long (exit code [`TIMEOUT_EXIT_CODE`]).
    pub fn timeout(mut self, limit: Option<Duration>) -> Self {
        self.timeout = limit;
        self
    }

    /// Time between SIGTERM and SIGKILL when stopping ranks.
    pub fn kill_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// The ranks' shared-memory directory (`BTL_SHM_DIR` as they see it),
    /// cleaned of older builds' leftovers.
    fn shm_dir(&self) -> std::path::PathBuf {
        match self.env.iter().rev().find(|(k, _)| k == "BTL_SHM_DIR") {
            Some((_, dir)) => dir.into(),
            None => crate::sys::shm::shm_dir(),
        }
    }

    /// Run the job to the end and return the exit code for the launcher.
    ///
    /// Needs a tokio runtime with I/O, time and signal drivers. The ranks'
    /// death signal is tied to the thread that starts them: run this on a
    /// thread that lives until it returns (a current-thread runtime's
    /// thread, or any worker of a multi-thread runtime).
    ///
    /// # Errors
    /// [`Error::Config`] for zero ranks; [`Error::Os`] when the rendezvous
    /// cannot be bound, a signal handler cannot be installed, or a rank
    /// cannot be started (the ranks already started are stopped first).
    pub async fn run(self) -> Result<i32> {
        if self.ranks == 0 {
            return Err(Error::Config(
                "a job needs at least one rank (-n 1 or more)".into(),
            ));
        }
        let key = JobKey::random();
        let job_id = format!(
            "btl-run-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        );
        let server =
            RendezvousServer::bind("127.0.0.1:0", self.ranks, key.clone(), ROUND_LIMIT).await?;
        let port = server.local_addr()?.port();
        let serving = tokio::spawn(server.serve());
        let mut sigint = signal(SignalKind::interrupt())
            .map_err(|e| Error::os("installing a SIGINT handler", e))?;
        let mut sigterm = signal(SignalKind::terminate())
            .map_err(|e| Error::os("installing a SIGTERM handler", e))?;

        let (out_tx, out_writer) = output::writer(tokio::io::stdout());
        let (err_tx, err_writer) = output::writer(tokio::io::stderr());
        let mut pumps = Vec::new();
        let mut alive = BTreeMap::new();
        let mut waits = FuturesUnordered::new();
        for rank in 0..self.ranks {
            let btl_env = vec![
                ("BTL_RANK", rank.to_string()),
                ("BTL_SIZE", self.ranks.to_string()),
                ("BTL_LOCAL_RANK", rank.to_string()),
                ("BTL_LOCAL_SIZE", self.ranks.to_string()),
                ("BTL_RENDEZVOUS", format!("tcp:127.0.0.1:{port}")),
                ("BTL_RENDEZVOUS_HOST", "launcher".to_string()),
                ("BTL_JOB_KEY", key.to_hex()),
                ("BTL_JOB_ID", job_id.clone()),
            ];
            let spec = child::Spec {
                program: &self.program,
                args: &self.args,
                user_env: &self.env,
                btl_env,
            };
            let mut proc = match child::spawn(spec) {
                Ok(p) => p,
                Err(e) => {
                    for &pid in alive.values() {
                        child::signal_group(pid, libc::SIGKILL);
                    }
                    while waits.next().await.is_some() {}
                    serving.abort();
                    let program = self.program.to_string_lossy();
                    return Err(Error::os(format!("starting rank {rank} ({program})"), e));
                }
            };
            if let Some(out) = proc.stdout.take() {
                pumps.push(output::pump(rank, self.prefix, out, out_tx.clone()));
            }
            if let Some(err) = proc.stderr.take() {
                pumps.push(output::pump(rank, self.prefix, err, err_tx.clone()));
            }
            alive.insert(rank, proc.id().unwrap_or(0));
            waits.push(async move { (rank, proc.wait().await) });
        }
        drop((out_tx, err_tx));

        let pids: Vec<u32> = alive.values().copied().collect();
        let stop_code = supervise::Supervisor::new(alive, self.timeout, self.grace)
            .keep_going(self.keep_going)
            .run(waits, &mut sigint, &mut sigterm)
            .await;
        // Every rank is reaped. Their shared memory went with them (memory
        // files without a name); remove what ranks of older builds, which
        // kept segments in the shm dir, left there when a signal killed them.
        crate::sys::shm::remove_of_dead_in(&self.shm_dir(), &pids);
        serving.abort();
        // Forward what the ranks wrote last; a pipe kept open by a process
        // that escaped the rank's group must not keep us waiting.
        let drain = async {
            for p in &mut pumps {
                let _ = p.await;
            }
        };
        if tokio::time::timeout(DRAIN_LIMIT, drain).await.is_err() {
            pumps.iter().for_each(|p| p.abort());
        }
        let _ = tokio::join!(out_writer, err_writer);
        Ok(stop_code)
    }
}

/// Make an example "run with no flags": when no launcher started this
/// process, start `default_n` copies of it (same executable, same
/// arguments; `BTL_NP` overrides the count) under [`LocalJob`] and return
/// `Some(exit code)` for the caller to pass to [`std::process::exit`].
/// When a launcher did start it, return `None` and let it go on as a rank.
///
/// Call it first thing in `main`, before starting a runtime; it runs its
/// own on a separate thread. When the launcher variables are present but
/// inconsistent it also returns `None`, so that the program's own
/// [`JobInfo::from_env`] reports the error.
pub fn run_self_if_unlaunched(default_n: u32) -> Option<i32> {
    if !matches!(JobInfo::from_env(), Ok(None)) {
        return None;
    }
    Some(relaunch_self(default_n).unwrap_or_else(|e| {
        eprintln!("btl-run: {e}");
        1
    }))
}

fn relaunch_self(default_n: u32) -> Result<i32> {
    let ranks = match std::env::var("BTL_NP") {
        Ok(text) => text
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| {
                Error::Config(format!("BTL_NP={text:?} is not a positive number of ranks"))
            })?,
        Err(_) => default_n,
    };
    let exe =
        std::env::current_exe().map_err(|e| Error::os("finding the current executable", e))?;
    let job = LocalJob::new(exe, ranks).args(std::env::args_os().skip(1));
    let thread = std::thread::Builder::new()
        .name("btl-run".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| Error::os("starting the launcher's runtime", e))?;
            rt.block_on(job.run())
        })
        .map_err(|e| Error::os("starting the launcher's thread", e))?;
    thread
        .join()
        .unwrap_or_else(|_| Err(Error::Bootstrap("the launcher thread panicked".into())))
}

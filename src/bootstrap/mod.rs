//! Job bootstrap: who am I, how many are we, and where do we meet.
//!
//! [`JobInfo::from_env`] reads rank, size and local rank from the launcher
//! that started the process; [`all_gather`] then lets every rank publish an
//! opaque blob (its transports' addresses) and receive everyone's.
//!
//! # Launchers and precedence
//!
//! The first launcher whose variables are present decides, in this order:
//!
//! | launcher | rank / size | local rank / size | job id |
//! |---|---|---|---|
//! | `btl-run` | `BTL_RANK`, `BTL_SIZE` | `BTL_LOCAL_RANK`, `BTL_LOCAL_SIZE` | `BTL_JOB_ID` |
//! | Open MPI `mpirun` | `OMPI_COMM_WORLD_RANK`, `_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK`, `_LOCAL_SIZE` | `PMIX_NAMESPACE`, else `OMPI_MCA_ess_base_jobid` |
//! | Slurm `srun` | `SLURM_PROCID`, `SLURM_NTASKS` | `SLURM_LOCALID`; `SLURM_NTASKS_PER_NODE`, else this node's entry of `SLURM_TASKS_PER_NODE` (`2(x3),1`, by `SLURM_NODEID`) | `SLURM_JOB_ID.SLURM_STEP_ID` |
//! | PMI (e.g. Hydra) | `PMI_RANK`, `PMI_SIZE` | `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` | none |
//! | torchrun-style | `RANK`, `WORLD_SIZE` | `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | `TORCHELASTIC_RUN_ID` |
//!
//! A launcher is present when any of its rank/size/local variables is set
//! (for Slurm: `SLURM_PROCID`, since `SLURM_NTASKS` alone only means "inside
//! an allocation"). Once present, its set must be complete and consistent:
//! rank without size, an index not below its count, or a number that does not
//! parse is an [`Error::Config`] naming the variables. Local rank/size may be
//! absent for `btl-run`, PMI and torchrun; then every rank is taken to be on
//! this node. Empty values count as unset.
//!
//! These apply under any launcher: `BTL_RENDEZVOUS` (`tcp:HOST:PORT` or
//! `dir:/abs/path`), `BTL_RENDEZVOUS_HOST` (`rank0`, the default, or
//! `launcher`), `BTL_JOB_KEY` (64 hex digits) and `BTL_JOB_ID` (overrides the
//! launcher's job id). If any of them is set but no launcher gives a rank,
//! that is an error rather than "not launched".
//!
//! # Conflicts
//!
//! - Launchers below the winning one are ignored: an `mpirun` inside a Slurm
//!   allocation inherits the allocation's `SLURM_*`, and `mpirun` wins.
//! - Except for `BTL_RANK`/`BTL_SIZE`: when another launcher's complete,
//!   valid set is also present and disagrees with them, that is an error
//!   naming both sets, since somebody set one of them by hand. (`btl-run`
//!   removes the other launchers' rank variables from its ranks' environment,
//!   so `btl-run` started under `mpirun` or `srun` does not trip this.)
//!
//! # Rendezvous
//!
//! `BTL_RENDEZVOUS` wins when set. Otherwise: torchrun-style jobs use
//! `MASTER_ADDR:MASTER_PORT` served by rank 0 (the port after it when
//! `TORCHELASTIC_USE_AGENT_STORE=True`, since the elastic agent's own store
//! listens on `MASTER_PORT`); `btl-run`, `mpirun` and Slurm jobs whose ranks
//! all sit on this node meet in the per-job directory
//! `$TMPDIR/async-btl-<uid>/<job_id>` (`/tmp` by default; mode 0700, files
//! 0600); a multi-node job, or PMI without `BTL_JOB_ID`, must set
//! `BTL_RENDEZVOUS`.
//!
//! # Job key
//!
//! Every exchange proves knowledge of the job key (see [`JobKey`]).
//! `btl-run` always hands its ranks a fresh random `BTL_JOB_KEY`. Under the
//! other launchers, a job given no `BTL_JOB_KEY` derives its key from the
//! job id and a **per-user secret** ([`JobKey::for_job`]): 32 random bytes
//! in `BTL_SECRET_FILE`, else `$XDG_CONFIG_HOME/async-btl/secret`, else
//! `$HOME/.config/async-btl/secret`, created on first use with mode 0600
//! (in a directory of mode 0700) and refused when another user owns it or
//! its mode lets anyone else in. Only the user's own processes can read it,
//! so another user who knows the job id cannot compute the key. The ranks
//! of a job must all read the same secret: a home directory shared by the
//! nodes gives them that; otherwise set `BTL_SECRET_FILE` to a shared file,
//! or give every rank the same `BTL_JOB_KEY` (under `mpirun`:
//! `export BTL_JOB_KEY=$(openssl rand -hex 32)`, then `mpirun -x BTL_JOB_KEY
//! …`). A rank whose key differs is refused by the rendezvous with a message
//! that says so, and rank 0 logs which rank, from which address. Where no
//! secret can be kept (no writable home), set one of the two variables;
//! without them the job fails with an [`Error::Config`] saying so.
//!
//! # Directory clean-up
//!
//! In the directory rendezvous each rank writes `g<N>-rank-<r>` (N counts this
//! process's exchanges) atomically, reads everyone's, then writes a
//! `g<N>-done-<r>` marker. The rank that sees all markers removes the round's
//! files and the directory if it is empty, so nothing remains after a
//! successful job. After a failed exchange the files stay for inspection;
//! remove the directory before rerunning with the same job id.

mod client;
pub(crate) mod dir;
mod env;
mod key;
mod secret;
mod server;
mod spec;
pub(crate) mod wire;

#[cfg(test)]
mod env_tests;

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use key::JobKey;
pub use server::{RendezvousServer, ServerStats};
pub use spec::{Host, RendezvousSpec};

use crate::{Error, Rank, Result};

/// Which launcher started this process.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LauncherKind {
    /// Our own `btl-run` (`BTL_*`).
    BtlRun,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// Slurm's `srun` (`SLURM_*`).
    Slurm,
    /// A PMI launcher (`PMI_RANK`, `PMI_SIZE`).
    Pmi,
    /// torchrun or anything exporting `RANK`/`WORLD_SIZE`.
    Torchrun,
    /// Set up through [`JobInfo::builder`].
    Explicit,
}

impl LauncherKind {
    fn short_name(self) -> &'static str {
        match self {
            LauncherKind::BtlRun => "btl",
            LauncherKind::OpenMpi => "ompi",
            LauncherKind::Slurm => "slurm",
            LauncherKind::Pmi => "pmi",
            LauncherKind::Torchrun => "torch",
            LauncherKind::Explicit => "explicit",
        }
    }
}

impl fmt::Display for LauncherKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LauncherKind::BtlRun => "btl-run",
            LauncherKind::OpenMpi => "Open MPI mpirun",
            LauncherKind::Slurm => "Slurm",
            LauncherKind::Pmi => "PMI",
            LauncherKind::Torchrun => "torchrun",
            LauncherKind::Explicit => "explicit settings",
        })
    }
}

/// The shape of the job and how to reach the other ranks.
///
/// Build it with [`JobInfo::from_env`] or [`JobInfo::builder`]; the fields
/// are public to read. Clones share the count of exchanges done, so the
/// clones of one process's `JobInfo` take part in the same sequence of
/// [`all_gather`] rounds.
#[derive(Debug, Clone)]
pub struct JobInfo {
    /// This process's rank, `0..size`.
    pub rank: Rank,
    /// Number of ranks in the job.
    pub size: u32,
    /// Rank among the ranks on this node, `0..local_size`.
    pub local_rank: u32,
    /// Number of ranks on this node.
    pub local_size: u32,
    /// The launcher the values came from.
    pub launcher: LauncherKind,
    /// An identifier unique to this job (and step), used for per-job names.
    pub job_id: String,
    /// The secret every rank of the job shares.
    pub job_key: JobKey,
    /// Where the ranks meet for [`all_gather`].
    pub rendezvous: RendezvousSpec,
    /// Number of [`all_gather`] rounds started by this process.
    rounds: Arc<AtomicU32>,
    /// Connections refused by the rendezvous servers this process ran.
    refused: Arc<AtomicU64>,
}

impl JobInfo {
    /// Read the job from the process environment.
    ///
    /// Returns `Ok(None)` when no launcher variable is present at all (the
    /// program was started by hand). See the [module docs](self) for the
    /// variables, their precedence and the conflict rules.
    ///
    /// # Errors
    /// [`Error::Config`] for incomplete, unparsable or conflicting variables.
    pub fn from_env() -> Result<Option<JobInfo>> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`JobInfo::from_env`], with variables from `lookup` (for tests
    /// and embedding). `TMPDIR` is read through `lookup` too.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<JobInfo>> {
        env::from_lookup(&lookup)
    }

    /// Connections refused, over every [`all_gather`] round so far, by the
    /// TCP rendezvous server this process ran (rank 0 of a rendezvous
    /// hosted by rank 0; 0 for every other process).
    pub fn rendezvous_refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Start explicit settings for `rank` of `size`.
    pub fn builder(rank: Rank, size: u32) -> JobInfoBuilder {
        JobInfoBuilder {
            rank,
            size,
            local: None,
            launcher: LauncherKind::Explicit,
            job_id: None,
            job_key: None,
            rendezvous: None,
        }
    }
}

/// Explicit job settings; see [`JobInfo::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct JobInfoBuilder {
    rank: Rank,
    size: u32,
    local: Option<(u32, u32)>,
    launcher: LauncherKind,
    job_id: Option<String>,
    job_key: Option<JobKey>,
    rendezvous: Option<RendezvousSpec>,
}

impl JobInfoBuilder {
    /// Local rank and local size (default: all ranks on this node).
    pub fn local(mut self, local_rank: u32, local_size: u32) -> Self {
        self.local = Some((local_rank, local_size));
        self
    }

    /// The launcher to report (default [`LauncherKind::Explicit`]).
    pub fn launcher(mut self, launcher: LauncherKind) -> Self {
        self.launcher = launcher;
        self
    }

    /// The job id (default: derived from the rendezvous).
    pub fn job_id(mut self, job_id: impl Into<String>) -> Self {
        self.job_id = Some(job_id.into());
        self
    }

    /// The job key (default: derived from the job id and the per-user
    /// secret, see the [module docs](self)).
    pub fn job_key(mut self, key: JobKey) -> Self {
        self.job_key = Some(key);
        self
    }

    /// Where the ranks meet (required).
    pub fn rendezvous(mut self, spec: RendezvousSpec) -> Self {
        self.rendezvous = Some(spec);
        self
    }

    /// Check the settings and build the [`JobInfo`].
    ///
    /// # Errors
    /// [`Error::Config`] when a rank does not fit its size, the local counts
    /// do not fit the job, the rendezvous is missing, or, with no key given,
    /// the per-user secret cannot be used (its location comes from the
    /// process environment).
    pub fn build(self) -> Result<JobInfo> {
        let (rank, size) = (self.rank, self.size);
        if rank >= size {
            return Err(Error::Config(format!(
                "rank {rank} must be below the job size {size}"
            )));
        }
        let (local_rank, local_size) = self.local.unwrap_or((rank, size));
        if local_rank >= local_size || local_size > size {
            return Err(Error::Config(format!(
                "local rank {local_rank} of {local_size} does not fit a job of {size} ranks"
            )));
        }
        let rendezvous = self.rendezvous.ok_or_else(|| {
            Error::Config("no rendezvous given: use tcp:HOST:PORT or dir:/path".into())
        })?;
        let job_id = self
            .job_id
            .unwrap_or_else(|| format!("{}-{rendezvous}", self.launcher.short_name()));
        let job_key = match self.job_key {
            Some(key) => key,
            None => derived_key(&job_id, rank, self.launcher, &|name| {
                std::env::var(name).ok().filter(|v| !v.trim().is_empty())
            })?,
        };
        Ok(JobInfo {
            rank,
            size,
            local_rank,
            local_size,
            launcher: self.launcher,
            job_id,
            job_key,
            rendezvous,
            rounds: Arc::new(AtomicU32::new(0)),
            refused: Arc::new(AtomicU64::new(0)),
        })
    }
}

/// Exchange one blob per rank; every rank gets all `size` blobs, indexed by
/// rank. Returns only when every rank has joined, so it doubles as a barrier.
///
/// Call it the same number of times on every rank, one call at a time: the
/// rounds are matched by count. A job of one rank returns at once without
/// touching the rendezvous. With a TCP rendezvous served by rank 0, rank 0 binds the address
/// and serves this round in a spawned task (it must run inside a tokio
/// runtime with the `net` and `time` drivers).
///
/// # Errors
/// - [`Error::Timeout`] naming the missing ranks when not all joined within
///   `timeout` (or naming rank 0 when its server never opened);
/// - [`Error::Bootstrap`] when the rendezvous refused our job key, a peer's
///   file carries another key, or the server went away;
/// - [`Error::Os`] when rank 0 cannot bind or the directory cannot be used.
///
/// # Cancel safety
/// Not cancel safe: a dropped call leaves this rank half-joined, and the
/// other ranks will then time out or, if the blob was already delivered,
/// complete without it having seen the result.
pub async fn all_gather(job: &JobInfo, mine: Vec<u8>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
    let round = job.rounds.fetch_add(1, Ordering::Relaxed);
    if job.size == 1 {
        return Ok(vec![mine]);
    }
    match &job.rendezvous {
        RendezvousSpec::Tcp { addr, hosted_by } => {
            client::gather(job, round, addr, *hosted_by, mine, timeout).await
        }
        RendezvousSpec::Dir(path) => dir::gather(job, round, path, mine, timeout).await,
    }
}

/// The real user id of this process.
pub(crate) fn current_uid() -> u32 {
    // SAFETY: getuid takes no arguments, touches no memory of ours and
    // cannot fail (POSIX: "always successful").
    unsafe { libc::getuid() }
}

/// The key of a job given none: from the per-user secret (created on first
/// use) and the job id. Rank 0 says so at `debug`, once per job.
fn derived_key(
    job_id: &str,
    rank: Rank,
    launcher: LauncherKind,
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<JobKey> {
    let with_hint = |e: Error| match e {
        Error::Config(m) => Error::Config(format!("{m}. {}", job_key_hint(launcher))),
        other => other,
    };
    let path = secret::location(get).map_err(with_hint)?;
    let secret = secret::load_or_create(&path).map_err(with_hint)?;
    if rank == 0 {
        tracing::debug!(
            job_id,
            secret = %path.display(),
            "BTL_JOB_KEY is not set: the job key is derived from the job id and the per-user \
             secret, which every rank must read the same"
        );
    }
    Ok(JobKey::for_job(&secret, job_id))
}

/// How to give every rank of a job started by `launcher` the same key.
fn job_key_hint(launcher: LauncherKind) -> &'static str {
    match launcher {
        LauncherKind::OpenMpi => {
            "To set one: export BTL_JOB_KEY=$(openssl rand -hex 32), then pass it to every \
             rank with mpirun -x BTL_JOB_KEY ..."
        }
        LauncherKind::Slurm => {
            "To set one: export BTL_JOB_KEY=$(openssl rand -hex 32) before srun (srun passes \
             the environment on)"
        }
        LauncherKind::Explicit => "To set one: JobInfo::builder(..).job_key(..)",
        _ => {
            "To set one: export BTL_JOB_KEY=$(openssl rand -hex 32) (64 hex digits) in the \
             environment of every rank (btl-run sets a fresh one itself)"
        }
    }
}

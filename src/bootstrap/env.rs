//! Reading the job's shape from launcher environment variables.
//!
//! The rules are documented on the [`bootstrap`](super) module.

use super::spec::{parse_host, RendezvousSpec};
use super::{current_uid, JobInfo, JobKey, LauncherKind};
use crate::{Error, Result};

/// What one launcher's variables say about this process.
struct Identity {
    kind: LauncherKind,
    /// Variable names of rank and size, for conflict messages.
    vars: (&'static str, &'static str),
    rank: u32,
    size: u32,
    local_rank: u32,
    local_size: u32,
    job_id: Option<String>,
    /// Rendezvous to use when `BTL_RENDEZVOUS` is absent.
    fallback: Fallback,
}

enum Fallback {
    /// A per-job directory, possible only when every rank is on this node.
    LocalDir,
    /// A TCP server hosted by rank 0 (torchrun's MASTER_ADDR/MASTER_PORT).
    Rank0Tcp(String),
    /// Nothing: `BTL_RENDEZVOUS` must be set.
    None(&'static str),
}

/// Variables that, when set, make this process "launched" even without a
/// rank (so a missing rank is an error rather than "not launched").
const GENERIC_VARS: [&str; 4] = [
    "BTL_RENDEZVOUS",
    "BTL_RENDEZVOUS_HOST",
    "BTL_JOB_KEY",
    "BTL_JOB_ID",
];

type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;
/// One launcher's reader: `Ok(None)` when none of its variables is set.
type Parser = fn(Lookup<'_>) -> Result<Option<Identity>>;

pub(super) fn from_lookup(get: Lookup<'_>) -> Result<Option<JobInfo>> {
    // Empty values count as unset.
    let get = |name: &str| get(name).filter(|v| !v.trim().is_empty());
    let get: Lookup<'_> = &get;
    let parsers: [Parser; 5] = [btl_run, open_mpi, slurm, pmi, torchrun];

    let mut found = None;
    for (i, parse) in parsers.iter().enumerate() {
        if let Some(id) = parse(get)? {
            found = Some((i, id));
            break;
        }
    }
    let Some((i, id)) = found else {
        if let Some(var) = GENERIC_VARS.iter().find(|v| get(v).is_some()) {
            return Err(Error::Config(format!(
                "{var} is set but no launcher variables give this process a rank: start it \
                 with btl-run, mpirun, srun or torchrun, or set BTL_RANK and BTL_SIZE"
            )));
        }
        return Ok(None);
    };
    // Lower-precedence launchers: an explicit BTL_RANK/BTL_SIZE must agree
    // with them; other launchers simply win over the ones below them.
    for parse in &parsers[i + 1..] {
        let Ok(Some(other)) = parse(get) else {
            continue;
        };
        if id.kind == LauncherKind::BtlRun && (other.rank, other.size) != (id.rank, id.size) {
            return Err(Error::Config(format!(
                "{}={} {}={} disagree with {}={} {}={} set by {}: unset one of the two sets",
                id.vars.0,
                id.rank,
                id.vars.1,
                id.size,
                other.vars.0,
                other.rank,
                other.vars.1,
                other.size,
                other.kind
            )));
        }
        tracing::debug!(
            "{} variables found too; {} takes precedence",
            other.kind,
            id.kind
        );
    }
    finish(id, get).map(Some)
}

fn finish(id: Identity, get: Lookup<'_>) -> Result<JobInfo> {
    let job_id = get("BTL_JOB_ID").or(id.job_id);
    let rendezvous = match get("BTL_RENDEZVOUS") {
        Some(text) => RendezvousSpec::parse(
            text.trim(),
            parse_host(get("BTL_RENDEZVOUS_HOST").as_deref())?,
            "BTL_RENDEZVOUS",
        )?,
        None => match id.fallback {
            Fallback::Rank0Tcp(addr) => RendezvousSpec::Tcp {
                addr,
                hosted_by: super::Host::Rank0,
            },
            Fallback::None(why) => {
                return Err(Error::Config(format!(
                    "{}: {why}; set BTL_RENDEZVOUS=tcp:HOST:PORT (served by rank 0) or \
                     dir:/path/visible/to/all/ranks",
                    id.kind
                )))
            }
            Fallback::LocalDir if id.local_size < id.size => {
                return Err(Error::Config(format!(
                    "{}: the job spans several nodes ({} of {} ranks on this one), so a \
                     node-local directory cannot serve as rendezvous; set \
                     BTL_RENDEZVOUS=tcp:HOST:PORT (served by rank 0) or dir:/shared/path",
                    id.kind, id.local_size, id.size
                )))
            }
            Fallback::LocalDir => match &job_id {
                Some(job) => {
                    RendezvousSpec::default_dir(get("TMPDIR").as_deref(), current_uid(), job)?
                }
                None => {
                    return Err(Error::Config(format!(
                        "{} gives no job id, so there is no per-job directory to meet in; set \
                         BTL_RENDEZVOUS=tcp:HOST:PORT or dir:/path (or BTL_JOB_ID)",
                        id.kind
                    )))
                }
            },
        },
    };
    let job_id = job_id.unwrap_or_else(|| format!("{}-{rendezvous}", id.kind.short_name()));
    let job_key = match get("BTL_JOB_KEY") {
        Some(hex) => {
            JobKey::from_hex(&hex).map_err(|e| Error::Config(format!("BTL_JOB_KEY: {e}")))?
        }
        None => super::derived_key(&job_id, id.rank, id.kind, get)?,
    };
    tracing::debug!(
        launcher = %id.kind,
        rank = id.rank,
        size = id.size,
        local_rank = id.local_rank,
        local_size = id.local_size,
        %rendezvous,
        "launcher found"
    );
    JobInfo::builder(id.rank, id.size)
        .local(id.local_rank, id.local_size)
        .launcher(id.kind)
        .job_id(job_id)
        .job_key(job_key)
        .rendezvous(rendezvous)
        .build()
}

/// A number, or a message naming the variable.
fn num(get: Lookup<'_>, var: &str) -> Result<Option<u32>> {
    match get(var) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<u32>()
            .map(Some)
            .map_err(|_| Error::Config(format!("{var}={v:?} is not a non-negative integer"))),
    }
}

/// An (index, count) pair: both or neither, index below count.
fn pair(get: Lookup<'_>, who: LauncherKind, idx: &str, cnt: &str) -> Result<Option<(u32, u32)>> {
    match (num(get, idx)?, num(get, cnt)?) {
        (None, None) => Ok(None),
        (Some(_), None) | (None, Some(_)) => {
            let (set, unset) = if get(idx).is_some() {
                (idx, cnt)
            } else {
                (cnt, idx)
            };
            Err(Error::Config(format!(
                "{who}: {set} is set but {unset} is not; both are needed"
            )))
        }
        (Some(i), Some(n)) if i >= n => Err(Error::Config(format!(
            "{who}: {idx}={i} must be below {cnt}={n}"
        ))),
        (Some(i), Some(n)) => Ok(Some((i, n))),
    }
}

/// Rank/size plus optional local rank/size (defaulting to "one node").
fn identity(
    get: Lookup<'_>,
    kind: LauncherKind,
    vars: [&'static str; 4],
    job_id: Option<String>,
    fallback: Fallback,
) -> Result<Option<Identity>> {
    if vars.iter().all(|v| get(v).is_none()) {
        return Ok(None);
    }
    let Some((rank, size)) = pair(get, kind, vars[0], vars[1])? else {
        return Err(Error::Config(format!(
            "{kind}: {} is set but {} and {} are not",
            vars.iter().find(|v| get(v).is_some()).unwrap_or(&vars[2]),
            vars[0],
            vars[1]
        )));
    };
    let (local_rank, local_size) = pair(get, kind, vars[2], vars[3])?.unwrap_or((rank, size));
    Ok(Some(Identity {
        kind,
        vars: (vars[0], vars[1]),
        rank,
        size,
        local_rank,
        local_size,
        job_id,
        fallback,
    }))
}

fn btl_run(get: Lookup<'_>) -> Result<Option<Identity>> {
    let vars = ["BTL_RANK", "BTL_SIZE", "BTL_LOCAL_RANK", "BTL_LOCAL_SIZE"];
    identity(get, LauncherKind::BtlRun, vars, None, Fallback::LocalDir)
}

fn open_mpi(get: Lookup<'_>) -> Result<Option<Identity>> {
    let vars = [
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ];
    let job = get("PMIX_NAMESPACE").or_else(|| get("OMPI_MCA_ess_base_jobid"));
    identity(get, LauncherKind::OpenMpi, vars, job, Fallback::LocalDir)
}

fn slurm(get: Lookup<'_>) -> Result<Option<Identity>> {
    let kind = LauncherKind::Slurm;
    if get("SLURM_PROCID").is_none() {
        // SLURM_NTASKS etc. alone only mean "inside an allocation".
        return Ok(None);
    }
    let Some((rank, size)) = pair(get, kind, "SLURM_PROCID", "SLURM_NTASKS")? else {
        return Ok(None);
    };
    let local_rank = num(get, "SLURM_LOCALID")?.ok_or_else(|| {
        Error::Config("Slurm: SLURM_PROCID is set but SLURM_LOCALID is not".into())
    })?;
    let local_size = slurm_local_size(get)?;
    if local_rank >= local_size || local_size > size {
        return Err(Error::Config(format!(
            "Slurm: SLURM_LOCALID={local_rank} and {local_size} tasks on this node do not fit \
             SLURM_NTASKS={size}"
        )));
    }
    let job_id = get("SLURM_JOB_ID").map(|j| match get("SLURM_STEP_ID") {
        Some(step) => format!("{j}.{step}"),
        None => j,
    });
    Ok(Some(Identity {
        kind,
        vars: ("SLURM_PROCID", "SLURM_NTASKS"),
        rank,
        size,
        local_rank,
        local_size,
        job_id,
        fallback: Fallback::LocalDir,
    }))
}

/// Tasks on this node: `SLURM_NTASKS_PER_NODE`, else this node's entry of
/// `SLURM_TASKS_PER_NODE` (`2(x3),1` style, indexed by `SLURM_NODEID`).
fn slurm_local_size(get: Lookup<'_>) -> Result<u32> {
    if let Some(n) = num(get, "SLURM_NTASKS_PER_NODE")? {
        return Ok(n);
    }
    let Some(list) = get("SLURM_TASKS_PER_NODE") else {
        return Err(Error::Config(
            "Slurm: neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set, so the \
             number of tasks on this node is unknown"
                .into(),
        ));
    };
    let bad = || {
        Error::Config(format!(
            "Slurm: SLURM_TASKS_PER_NODE={list:?} is not a list like 4 or 2(x3),1"
        ))
    };
    let mut per_node = Vec::new();
    for item in list.split(',') {
        let (count, times) = match item.trim().split_once("(x") {
            Some((c, rest)) => (c, rest.strip_suffix(')').ok_or_else(bad)?),
            None => (item.trim(), "1"),
        };
        let count: u32 = count.parse().map_err(|_| bad())?;
        let times: u32 = times.parse().map_err(|_| bad())?;
        per_node.push((count, times));
    }
    let node = num(get, "SLURM_NODEID")?.unwrap_or(0);
    let mut first = 0u64;
    for &(count, times) in &per_node {
        if u64::from(node) < first + u64::from(times) {
            return Ok(count);
        }
        first += u64::from(times);
    }
    Err(Error::Config(format!(
        "Slurm: SLURM_NODEID={node} has no entry in SLURM_TASKS_PER_NODE={list:?}"
    )))
}

fn pmi(get: Lookup<'_>) -> Result<Option<Identity>> {
    // MPICH's Hydra adds MPI_LOCALRANKID/MPI_LOCALNRANKS.
    let vars = ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"];
    if get(vars[0]).is_none() && get(vars[1]).is_none() {
        return Ok(None);
    }
    let fallback = Fallback::None("PMI gives no job id or rendezvous address");
    let mut id = identity(get, LauncherKind::Pmi, vars, None, fallback)?;
    if let (Some(id), Some(_)) = (id.as_mut(), get("BTL_JOB_ID")) {
        id.fallback = Fallback::LocalDir;
    }
    Ok(id)
}

fn torchrun(get: Lookup<'_>) -> Result<Option<Identity>> {
    let vars = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"];
    let kind = LauncherKind::Torchrun;
    if vars.iter().all(|v| get(v).is_none()) {
        return Ok(None);
    }
    let master = match (get("MASTER_ADDR"), num(get, "MASTER_PORT")?) {
        (Some(addr), Some(port)) => {
            // Under torchrun's static rendezvous the elastic agent's own
            // store already listens on MASTER_PORT; take the next port.
            let agent_store =
                get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true"));
            let port = port + u32::from(agent_store);
            if port > u32::from(u16::MAX) {
                return Err(Error::Config(format!(
                    "MASTER_PORT={port} is not a TCP port"
                )));
            }
            let host = if addr.contains(':') {
                format!("[{addr}]")
            } else {
                addr
            };
            Some(format!("{host}:{port}"))
        }
        (None, None) => None,
        (Some(_), None) => return partial(kind, "MASTER_ADDR", "MASTER_PORT"),
        (None, Some(_)) => return partial(kind, "MASTER_PORT", "MASTER_ADDR"),
    };
    let job = get("TORCHELASTIC_RUN_ID").or_else(|| master.as_ref().map(|m| format!("torch-{m}")));
    let fallback = match master {
        Some(addr) => Fallback::Rank0Tcp(addr),
        None => Fallback::None("MASTER_ADDR and MASTER_PORT are not set"),
    };
    identity(get, kind, vars, job, fallback)
}

fn partial<T>(who: LauncherKind, set: &str, unset: &str) -> Result<T> {
    Err(Error::Config(format!(
        "{who}: {set} is set but {unset} is not; both are needed"
    )))
}

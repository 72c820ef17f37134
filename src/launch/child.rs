//! Starting one rank process and signalling its process group.

use std::ffi::OsString;
use std::process::{ExitStatus, Stdio};

use tokio::process::{Child, Command};

/// Other launchers' rank variables: they describe the launcher's own
/// process, not our ranks, and would conflict with `BTL_RANK`.
const FOREIGN_RANK_VARS: [&str; 14] = [
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
];

/// Everything needed to start one rank.
pub(super) struct Spec<'a> {
    pub program: &'a OsString,
    pub args: &'a [OsString],
    pub user_env: &'a [(OsString, OsString)],
    pub btl_env: Vec<(&'static str, String)>,
}

/// Start a rank in its own process group, with piped stdout/stderr, stdin
/// from /dev/null, and `PR_SET_PDEATHSIG` so it dies with the thread that
/// started it (ours).
pub(super) fn spawn(spec: Spec<'_>) -> std::io::Result<Child> {
    let mut cmd = Command::new(spec.program);
    cmd.args(spec.args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own group: a terminal's Ctrl-C reaches only us (we forward
        // it), and killing the group also reaches the rank's children.
        .process_group(0);
    for var in FOREIGN_RANK_VARS {
        cmd.env_remove(var);
    }
    cmd.envs(spec.user_env.iter().map(|(k, v)| (k, v)));
    cmd.envs(spec.btl_env);
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec, where only
    // async-signal-safe calls are allowed: it calls prctl and getppid (both
    // async-signal-safe system calls), allocates nothing, takes no locks and
    // touches only the copied `parent` integer. Failure is reported through
    // io::Error::last_os_error, which only reads errno.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // We may have died between fork and prctl: then nobody would
            // ever send the death signal, so give up now.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::other(
                    "btl-run exited while starting the rank",
                ));
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// Send `sig` to the process group led by `pid` (the rank and everything it
/// started that stayed in its group). Errors (group already gone) are
/// ignored.
pub(super) fn signal_group(pid: u32, sig: i32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    if pid <= 1 {
        return;
    }
    // SAFETY: kill(2) only takes integers; a negative pid addresses the
    // process group. The caller only passes groups of ranks it started and
    // has not yet reaped (or reaped a moment ago, to catch stragglers).
    unsafe {
        libc::kill(-pid, sig);
    }
}

/// The shell's convention: the exit code, or 128 + the signal number.
pub(super) fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => 1,
    }
}

/// Words for a log line: "exited with code 3" or "was killed by signal 9".
pub(super) fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        (None, None) => "ended in an unknown way".into(),
    }
}

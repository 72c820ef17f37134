//! Watching the ranks: exits, the launcher's signals, the job's timeout.

use std::collections::BTreeMap;
use std::future::Future;
use std::process::ExitStatus;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::signal::unix::Signal;
use tokio::time::Instant;

use super::{child, TIMEOUT_EXIT_CODE};

/// The state of a running job.
pub(super) struct Supervisor {
    /// Ranks not yet reaped: rank → pid (= process group id).
    alive: BTreeMap<u32, u32>,
    timeout: Option<Duration>,
    grace: Duration,
    /// Set by the first failure, signal or timeout: the launcher's exit code.
    stop_code: Option<i32>,
    /// When the ranks still alive get SIGKILL.
    kill_at: Option<Instant>,
    /// A failing rank does not stop the others.
    keep_going: bool,
    /// The first failing rank's exit code, in keep-going mode.
    failed_code: Option<i32>,
}

impl Supervisor {
    pub(super) fn new(
        alive: BTreeMap<u32, u32>,
        timeout: Option<Duration>,
        grace: Duration,
    ) -> Self {
        Supervisor {
            alive,
            timeout,
            grace,
            stop_code: None,
            kill_at: None,
            keep_going: false,
            failed_code: None,
        }
    }

    /// Let the other ranks run on when one fails.
    pub(super) fn keep_going(mut self, on: bool) -> Self {
        self.keep_going = on;
        self
    }

    /// Wait until every rank has exited; return the launcher's exit code.
    pub(super) async fn run<F>(
        mut self,
        mut waits: FuturesUnordered<F>,
        sigint: &mut Signal,
        sigterm: &mut Signal,
    ) -> i32
    where
        F: Future<Output = (u32, std::io::Result<ExitStatus>)>,
    {
        let job_deadline = self.timeout.map(|t| Instant::now() + t);
        while !waits.is_empty() {
            let timeout_armed = self.stop_code.is_none();
            let kill_armed = !self.alive.is_empty();
            tokio::select! {
                Some((rank, status)) = waits.next() => self.exited(rank, status),
                _ = sigint.recv() => {
                    self.stop("interrupted (SIGINT)".into(), 128 + libc::SIGINT, Some(libc::SIGINT));
                }
                _ = sigterm.recv() => {
                    self.stop("terminated (SIGTERM)".into(), 128 + libc::SIGTERM, Some(libc::SIGTERM));
                }
                () = sleep_until(job_deadline), if timeout_armed => {
                    let why = format!("the job's timeout of {:?} expired", self.timeout.unwrap_or_default());
                    self.stop(why, TIMEOUT_EXIT_CODE, None);
                }
                () = sleep_until(self.kill_at), if kill_armed => {
                    let left: Vec<_> = self.alive.keys().collect();
                    tracing::warn!("ranks {left:?} outlived the {:?} grace period; sending SIGKILL", self.grace);
                    self.signal_all(libc::SIGKILL);
                    self.kill_at = None;
                }
            }
        }
        self.stop_code.or(self.failed_code).unwrap_or(0)
    }

    fn exited(&mut self, rank: u32, status: std::io::Result<ExitStatus>) {
        let pid = self.alive.remove(&rank).unwrap_or(0);
        // Whatever the rank left running in its group goes too.
        child::signal_group(pid, libc::SIGKILL);
        let (why, code) = match status {
            Ok(s) if s.success() => return,
            Ok(s) => (
                format!("rank {rank} {}", child::describe(s)),
                child::exit_code(s),
            ),
            Err(e) => (format!("waiting for rank {rank} failed: {e}"), 1),
        };
        if self.keep_going && self.stop_code.is_none() {
            // The survivors see it as a lost peer; the launcher reports
            // the first failure's code at the end.
            tracing::error!("{why}; the other ranks keep going (--keep-going)");
            self.failed_code.get_or_insert(code);
        } else {
            self.stop(why, code, None);
        }
    }

    /// The first call records `code`, sends `forward` (default SIGTERM) to
    /// every rank and arms SIGKILL after the grace period. A later signal
    /// to the launcher (a second Ctrl-C) sends SIGKILL at once.
    fn stop(&mut self, why: String, code: i32, forward: Option<i32>) {
        if self.stop_code.is_none() {
            self.stop_code = Some(code);
            if self.alive.is_empty() {
                tracing::error!("{why}");
            } else {
                tracing::error!("{why}; stopping the other ranks");
            }
            self.signal_all(forward.unwrap_or(libc::SIGTERM));
            self.kill_at = Some(Instant::now() + self.grace);
        } else if forward.is_some() {
            tracing::warn!("{why} again; killing the ranks");
            self.signal_all(libc::SIGKILL);
        }
    }

    fn signal_all(&self, sig: i32) {
        for &pid in self.alive.values() {
            child::signal_group(pid, sig);
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

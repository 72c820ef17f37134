//! Address exchange: how ranks learn each other's transport addresses.
//!
//! [`AddressExchange`] is public so a program can plug in its own bootstrap
//! (an MPI all-gather, a key-value store). Built in: the launcher's
//! rendezvous ([`crate::bootstrap`]) and [`LocalExchange`] for ranks that are
//! threads or tasks of one process.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;

use crate::sys::sync::lock;
use crate::{Error, Rank, Result};

/// Every rank contributes a blob; every rank receives all blobs by rank.
/// Must also act as a barrier: it returns only once every rank contributed.
#[async_trait]
pub trait AddressExchange: Send + Sync {
    /// Publish `mine` as rank `rank`'s blob and return every rank's blob.
    async fn all_gather(&self, rank: Rank, mine: Vec<u8>) -> Result<Vec<Vec<u8>>>;

    /// Connections this process's side of the exchange refused so far
    /// (reported as [`Stats::rendezvous_refused`](crate::Stats)); 0 for an
    /// exchange that serves nobody.
    fn refused(&self) -> u64 {
        0
    }
}

type Slots = Vec<Option<Vec<u8>>>;

/// An exchange between ranks that live in one process (threads or tasks),
/// e.g. for tests or for a single-process program that wants several
/// fabrics. Clone it into every rank.
#[derive(Clone)]
pub struct LocalExchange {
    inner: Arc<(Mutex<Slots>, Notify)>,
    timeout: Duration,
}

impl LocalExchange {
    /// An exchange for `size` ranks.
    pub fn new(size: u32) -> Self {
        LocalExchange {
            inner: Arc::new((Mutex::new(vec![None; size as usize]), Notify::new())),
            timeout: Duration::from_secs(30),
        }
    }
}

#[async_trait]
impl AddressExchange for LocalExchange {
    async fn all_gather(&self, rank: Rank, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let (slots, notify) = &*self.inner;
        {
            let mut s = lock(slots);
            let slot = s
                .get_mut(rank as usize)
                .ok_or_else(|| Error::Misuse(format!("rank {rank} is outside the exchange")))?;
            *slot = Some(mine);
        }
        notify.notify_waiters();
        let wait = async {
            loop {
                let n = notify.notified();
                tokio::pin!(n);
                n.as_mut().enable();
                {
                    let s = lock(slots);
                    if s.iter().all(Option::is_some) {
                        return s.iter().map(|b| b.clone().unwrap_or_default()).collect();
                    }
                }
                n.await;
            }
        };
        tokio::time::timeout(self.timeout, wait).await.map_err(|_| {
            let s = lock(slots);
            let missing: Vec<usize> = (0..s.len()).filter(|i| s[*i].is_none()).collect();
            Error::Bootstrap(format!(
                "ranks {missing:?} did not join within {:?}",
                self.timeout
            ))
        })
    }
}

/// The launcher's rendezvous (see [`crate::bootstrap`]) as an exchange.
pub struct JobExchange {
    job: crate::bootstrap::JobInfo,
    timeout: Duration,
}

impl JobExchange {
    /// Exchange through `job`'s rendezvous, giving up after `timeout`.
    pub fn new(job: crate::bootstrap::JobInfo, timeout: Duration) -> Self {
        JobExchange { job, timeout }
    }
}

#[async_trait]
impl AddressExchange for JobExchange {
    async fn all_gather(&self, rank: Rank, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        if rank != self.job.rank {
            return Err(Error::Misuse(format!(
                "rank {rank} used the exchange of rank {}",
                self.job.rank
            )));
        }
        crate::bootstrap::all_gather(&self.job, mine, self.timeout).await
    }

    fn refused(&self) -> u64 {
        self.job.rendezvous_refused()
    }
}

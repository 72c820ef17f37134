//! A test double of a NIC with native one-sided operations (for tests on
//! machines without RDMA hardware), built only for the crate's own tests.
//!
//! It joins a fabric through the registry alone, and only a fabric that
//! names it in its transport list: fabrics of one process (ranks as tasks)
//! reach each other's registered memory through a process-wide table, and
//! carry put, get and atomics natively — posted to a queue at the
//! initiator, carried out and completed by the transport's progress, as a
//! completion queue would — while another transport (`sm`) carries the
//! messages. The target's region table checks every access, as a NIC's
//! memory registration would.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use super::registry::{Entry, Job};
use super::{Kind, Link, Local, Native, OneSided, Peer, Transport};
use crate::core::completion::{Completion, Done, Tally};
use crate::core::fabric::Core;
use crate::core::region::{KeyId, RegionInner};
use crate::sys::mem::AtomicOp;
use crate::sys::sync::lock;
use crate::{Error, Rank, Result};

/// The fabrics of this process that run the double, by (job, rank).
static FABRICS: Mutex<Option<Fabrics>> = Mutex::new(None);

/// Fabrics by (job tag, rank).
type Fabrics = HashMap<([u64; 2], Rank), Weak<Core>>;

/// The registry's entry: opened only where the transport list names it.
#[linkme::distributed_slice(crate::transport::registry::TRANSPORTS)]
pub(crate) static ENTRY: Entry = Entry {
    rank: 10,
    name: "double",
    messages: false,
    one_sided: true,
    implicit: false,
    device_memory: false,
    reach: crate::transport::registry::Reach::Node,
    not_built: None,
    probe: || Ok("a test double: fabrics of one process, one-sided only".into()),
    open: |core, _job: &Job| {
        if !core.config().transports.iter().any(|t| t == "double") {
            return Ok(None);
        }
        lock(&FABRICS)
            .get_or_insert_with(HashMap::new)
            .insert((core.job_tag(), core.rank()), Arc::downgrade(core));
        Ok(Some(Arc::new(Double {
            core: Arc::downgrade(core),
            rank: core.rank(),
            job: core.job_tag(),
            queue: Mutex::new(VecDeque::new()),
            carried: AtomicU64::new(0),
        }) as Arc<dyn Transport>))
    },
    alloc_shared: None,
};

/// A posted operation, carried out by progress.
struct Posted {
    target: Rank,
    what: What,
    key: KeyId,
    offset: u64,
    done: Done,
}

enum What {
    Put(Arc<RegionInner>, u64, usize),
    Get(Arc<RegionInner>, u64, usize),
    Atomic(AtomicOp),
}

pub(crate) struct Double {
    core: Weak<Core>,
    rank: Rank,
    job: [u64; 2],
    queue: Mutex<VecDeque<Posted>>,
    /// Operations carried so far (what a test checks).
    pub(crate) carried: AtomicU64,
}

struct DoubleLink {
    t: Arc<Double>,
    peer: Rank,
}

impl Double {
    fn target(&self, rank: Rank) -> Option<Arc<Core>> {
        lock(&FABRICS).as_ref()?.get(&(self.job, rank))?.upgrade()
    }

    /// Carry out one posted operation at its target.
    fn carry(&self, mut p: Posted) {
        let Some(core) = self.target(p.target) else {
            return p.done.complete(Err(Error::PeerLost {
                rank: p.target,
                reason: "its fabric is gone".into(),
            }));
        };
        let len = match &p.what {
            What::Put(_, _, n) | What::Get(_, _, n) => *n,
            What::Atomic(_) => 8,
        };
        let region = match core.target_region(&p.key, p.offset, len) {
            Ok(r) => r,
            Err(e) => return p.done.complete(Err(e.into())),
        };
        let remote = region.raw();
        let r = match p.what {
            What::Put(src, at, n) => remote.copy_from(p.offset, &src.raw(), at, n),
            What::Get(dst, at, n) => dst.raw().copy_from(at, &remote, p.offset, n),
            What::Atomic(op) => match remote.atomic(p.offset, op) {
                Ok(old) => {
                    self.carried.fetch_add(1, Ordering::Relaxed);
                    return match &mut p.done {
                        Done::Slot(c) => c.complete_value(old),
                        counted => counted.complete(Ok(())),
                    };
                }
                Err(e) => Err(e),
            },
        };
        self.carried.fetch_add(1, Ordering::Relaxed);
        p.done.complete(r.map_err(Error::from));
    }
}

impl Link for DoubleLink {
    fn peer(&self) -> Rank {
        self.peer
    }

    fn transport(&self) -> &'static str {
        "double"
    }

    fn try_send(&self, _: Kind, _: u64, _: &[u8]) -> Result<bool> {
        Err(Error::Misuse("the test double carries no messages".into()))
    }

    fn submit(&self, _: Kind, _: u64, _: Bytes) -> Result<Option<Arc<Completion>>> {
        Err(Error::Misuse("the test double carries no messages".into()))
    }

    fn post(&self, op: OneSided<'_>, tally: Option<&Arc<Tally>>) -> Result<Native> {
        let local = |l: Local<'_>| (l.region.clone(), l.offset, l.raw.len());
        let (what, key, offset) = match op {
            OneSided::Put { src, key, offset } => {
                let (r, at, n) = local(src);
                (What::Put(r, at, n), key, offset)
            }
            OneSided::Get { dst, key, offset } => {
                let (r, at, n) = local(dst);
                (What::Get(r, at, n), key, offset)
            }
            OneSided::Atomic { key, offset, op } => (What::Atomic(op), key, offset),
        };
        // Implicit puts and gets counted in the peer's tally, as `rdma`
        // counts them.
        let (done, answer) = match tally {
            Some(t) => (Done::Count(t.start()), Native::Counted),
            None => {
                let c = Completion::new();
                (Done::Slot(c.clone()), Native::Posted(c))
            }
        };
        lock(&self.t.queue).push_back(Posted {
            target: self.peer,
            what,
            key: key.id,
            offset,
            done,
        });
        Ok(answer)
    }

    fn has_queued(&self) -> bool {
        false
    }
}

#[async_trait]
impl Transport for Double {
    fn name(&self) -> &'static str {
        "double"
    }

    fn address(&self) -> Result<Vec<u8>> {
        let mut a = crate::sys::os::pid().to_le_bytes().to_vec();
        a.extend(self.job[0].to_le_bytes());
        Ok(a)
    }

    fn reaches(&self, peer: &Peer<'_>) -> Result<bool> {
        Ok(peer.rank != self.rank && peer.addr == self.address()?.as_slice())
    }

    fn connect(self: Arc<Self>, peers: &[Peer<'_>]) -> Result<Vec<(Rank, Arc<dyn Link>)>> {
        Ok(peers
            .iter()
            .map(|p| {
                let link = DoubleLink {
                    t: self.clone(),
                    peer: p.rank,
                };
                (p.rank, Arc::new(link) as Arc<dyn Link>)
            })
            .collect())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn progress(&self) -> usize {
        let mut n = 0;
        while let Some(p) = lock(&self.queue).pop_front() {
            self.carry(p);
            n += 1;
        }
        n
    }

    fn arm(&self) -> bool {
        lock(&self.queue).is_empty()
    }

    fn disarm(&self) {}

    async fn wait(&self, timeout: Duration) {
        tokio::time::sleep(timeout.min(Duration::from_micros(100))).await;
    }

    fn check_peers(&self) {}

    fn drained(&self) -> bool {
        lock(&self.queue).is_empty()
    }

    fn shutdown(&self) {
        for mut p in lock(&self.queue).drain(..) {
            p.done.complete(Err(Error::Closed));
        }
        if let (Some(m), Some(_)) = (lock(&FABRICS).as_mut(), self.core.upgrade()) {
            m.remove(&(self.job, self.rank));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Config, FabricBuilder, LocalExchange, MemoryKind};

    /// The double joins through the registry alone and carries the
    /// one-sided operations natively while `sm` carries the messages.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_test_double_nic_carries_one_sided_operations_beside_sm() {
        let ex = LocalExchange::new(2);
        let config = Config {
            transports: vec!["sm".into(), "double".into()],
            ..Config::default()
        };
        let open = |r| {
            let (ex, config) = (ex.clone(), config.clone());
            async move {
                FabricBuilder::new(r, 2)
                    .job_key([9u8; 32])
                    .config(config)
                    .build(&ex)
                    .await
            }
        };
        let (a, b) = tokio::try_join!(open(0), open(1)).unwrap();
        assert_eq!(a.transport_for(1), Some("sm"));
        assert_eq!(a.rma_transport_for(1, MemoryKind::Host), Some("double"));
        let ep = a.endpoint(1).unwrap();
        assert_eq!(ep.transport(), "sm");

        let target = b.register(crate::PageBuf::zeroed(4096));
        let key = target.remote_key();
        let src = a.register((0..=255u8).cycle().take(1000).collect::<Vec<u8>>());
        ep.put(&src, 0..1000, &key, 100).await.unwrap();
        let back = a.register(vec![0u8; 1000]);
        ep.get(&back, 0..1000, &key, 100).await.unwrap();
        assert_eq!(back.to_vec(), src.to_vec());
        assert_eq!(ep.fetch_add(&key, 2048, 5).await.unwrap(), 0);
        assert_eq!(ep.compare_swap(&key, 2048, 5, 9).await.unwrap(), 5);
        ep.put_nbi(&src, 0..8, &key, 0).unwrap();
        ep.atomic_add_nbi(&key, 2048, 1).unwrap();
        ep.flush().await.unwrap();
        let mut w = [0u8; 8];
        target.read(2048, &mut w).unwrap();
        assert_eq!(u64::from_le_bytes(w), 10);
        // Implicit gets, counted in the peer's tally, are in by the flush.
        let back2 = a.register(vec![0u8; 1000]);
        for at in (0..1000).step_by(100) {
            ep.get_nbi(&back2, at..at + 100, &key, 100 + at as u64)
                .unwrap();
        }
        ep.flush().await.unwrap();
        assert_eq!(back2.to_vec(), src.to_vec());
        // A forged key's implicit put: refused by the target's table,
        // reported by the next flush, once.
        let mut bad = key.to_bytes();
        bad[5] ^= 0x55;
        let forged = crate::RemoteKey::from_bytes(&bad).unwrap();
        ep.put_nbi(&src, 0..8, &forged, 0).unwrap();
        let e = ep.flush().await.unwrap_err();
        assert!(matches!(e, Error::Access(_)), "{e}");
        ep.flush().await.unwrap();
        // Refused by the target's table, memory untouched.
        let e = ep.put(&src, 0..8, &key, 4092).await.unwrap_err();
        assert!(matches!(e, Error::Access(_)), "{e}");
        // Messages still flow over sm.
        let mut rx = b.receiver(1).unwrap();
        ep.send(1, &b"over sm"[..]).await.unwrap();
        assert_eq!(&rx.recv().await.unwrap().data[..], b"over sm");
        let carried = a
            .transports
            .iter()
            .find_map(|t| t.as_any().downcast_ref::<Double>())
            .map(|d| d.carried.load(Ordering::Relaxed));
        assert_eq!(
            carried,
            Some(16),
            "put, get, two atomics, two implicit, ten implicit gets"
        );
        assert_eq!(a.stats().direct_puts, 0);
        tokio::try_join!(a.close(), b.close()).unwrap();
    }
}

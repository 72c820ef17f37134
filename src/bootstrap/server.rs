//! The TCP rendezvous server, run in-process by rank 0 or by `btl-run`.
//!
//! Strangers may connect too. A connection is *unauthenticated* until its
//! join proves the job key; each of those runs its handshake in a task of
//! its own under [`HANDSHAKE_LIMIT`], at most [`MIN_PENDING`] (or the job's
//! size, if larger) at once, the oldest shed to make room for a new one and
//! half of them when accepting runs out of descriptors. None of that waits
//! on or delays an authenticated rank, and every refusal is counted by
//! cause ([`ServerStats`]) and summed up in the log.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rand::RngCore;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::task::{AbortHandle, Id, JoinSet};
use tokio::time::Instant;

use super::wire::{self, FrameError, ToClient, ToServer};
use super::JobKey;
use crate::{Error, Result};

/// How long an unauthenticated connection may take to present its join.
/// A rank cut off retries with a new connection.
pub(crate) const HANDSHAKE_LIMIT: Duration = Duration::from_secs(2);
/// Unauthenticated connections held at once: at least this many, or the
/// job's size when larger (every rank may be connecting at the same time).
pub(crate) const MIN_PENDING: usize = 64;
/// Pause before accepting again after running out of descriptors: long
/// enough for the shed connections to be closed...
const ACCEPT_BACKOFF: Duration = Duration::from_millis(5);
/// ... or, with none to shed, for the process to close some of its own.
const STARVED_BACKOFF: Duration = Duration::from_millis(50);
/// Connections the kernel queues before we accept them (capped by
/// `net.core.somaxconn`).
const BACKLOG: i32 = 1024;
/// How long a finished server waits for its last answers to be written.
const FLUSH_LIMIT: Duration = Duration::from_secs(5);
/// Refusals logged one by one at `warn` per server; the rest at `debug`.
const WARN_REFUSALS: u32 = 16;

/// A TCP rendezvous server for one job.
///
/// It serves [`all_gather`](super::all_gather) rounds one after the other:
/// a round completes when all `size` ranks have joined, and then every rank
/// gets all blobs. Every connection must prove it holds the job key within
/// 2 s of being accepted; the others are refused, counted
/// ([`ServerStats::refused`]) and logged. Connections still handshaking do
/// not hold up the ranks that have joined, and their number is capped, so
/// strangers can neither stall a round nor exhaust the server's
/// descriptors.
///
/// `btl-run` binds port 0 first and hands the real port to its ranks, so
/// there is no race for the port.
#[derive(Debug)]
pub struct RendezvousServer {
    listener: TcpListener,
    shared: Arc<Shared>,
    /// Stop after this round completes (rank 0's in-process server).
    last_round: Option<u32>,
}

/// Counters of a [`RendezvousServer`], readable while it serves.
///
/// [`refused`](Self::refused) counts every connection that did not join;
/// the other counts split it by cause (what is in none of them was a
/// protocol error: bad frames, a rank out of range, a wrong job size, a
/// stale round, a duplicate rank, or a connection closed before its join).
#[derive(Debug, Clone)]
pub struct ServerStats(Arc<Shared>);

impl ServerStats {
    /// Connections refused, for any cause.
    pub fn refused(&self) -> u64 {
        self.0.count(Refusal::Any)
    }

    /// Connections that presented no join within the handshake limit, or
    /// were still handshaking when the server closed.
    pub fn timed_out(&self) -> u64 {
        self.0.count(Refusal::TimedOut)
    }

    /// Joins whose proof was not made with the job key.
    pub fn bad_key(&self) -> u64 {
        self.0.count(Refusal::BadKey)
    }

    /// Unauthenticated connections closed to make room: over the cap of
    /// simultaneous handshakes, or when accepting ran out of descriptors.
    pub fn shed(&self) -> u64 {
        self.0.count(Refusal::Shed)
    }

    /// Rounds finished so far, completed or failed by the timeout.
    pub fn rounds_finished(&self) -> u32 {
        self.0.lock().number - self.0.first_round
    }
}

/// Why a connection was refused; each has its counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// Every refusal (the total).
    Any = 0,
    TimedOut = 1,
    BadKey = 2,
    Shed = 3,
    /// A protocol error, logged at `warn` like a bad key.
    Protocol = 4,
    /// Gone before its join (a port scan, a rank that gave up), logged at
    /// `debug`; counted with the protocol errors as "other".
    Left = 5,
}

#[derive(Debug)]
struct Shared {
    size: u32,
    key: JobKey,
    timeout: Duration,
    first_round: u32,
    /// Per [`Refusal`], indexed by its value.
    refused: [AtomicU64; 6],
    /// The total at the last summary line.
    reported: AtomicU64,
    /// Refusals logged at `warn` so far.
    warned: AtomicU32,
    state: Mutex<Round>,
    /// Published when a round ends: (round, outcome).
    done: watch::Sender<Option<(u32, Outcome)>>,
    /// Rung when a round gets its first join (its deadline starts).
    started: Notify,
}

#[derive(Debug, Default)]
struct Round {
    number: u32,
    /// Each rank's blob, and the address it came from.
    blobs: BTreeMap<u32, (Vec<u8>, SocketAddr)>,
    deadline: Option<Instant>,
}

#[derive(Debug, Clone)]
enum Outcome {
    All(Arc<Vec<Vec<u8>>>),
    Missing(Vec<u32>),
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Round> {
        // A panic while holding the lock leaves consistent data (plain
        // inserts), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn missing(&self, round: &Round) -> Vec<u32> {
        (0..self.size)
            .filter(|r| !round.blobs.contains_key(r))
            .collect()
    }

    fn count(&self, kind: Refusal) -> u64 {
        self.refused[kind as usize].load(Ordering::Relaxed)
    }

    /// Count and log one refusal of `who` ("rank 3 at ADDR", or the address).
    fn refuse(&self, who: &str, kind: Refusal, why: &str) {
        self.refused[Refusal::Any as usize].fetch_add(1, Ordering::Relaxed);
        self.refused[kind as usize].fetch_add(1, Ordering::Relaxed);
        let loud = matches!(kind, Refusal::BadKey | Refusal::Protocol)
            && self.warned.fetch_add(1, Ordering::Relaxed) < WARN_REFUSALS;
        if loud {
            tracing::warn!("rendezvous refused {who}: {why}");
        } else {
            tracing::debug!("rendezvous refused {who}: {why}");
        }
    }

    /// Log the refusals in all, when there are new ones since the last line.
    fn report(&self) {
        let total = self.count(Refusal::Any);
        if self.reported.swap(total, Ordering::Relaxed) == total {
            return;
        }
        let (timed_out, bad_key, shed) = (
            self.count(Refusal::TimedOut),
            self.count(Refusal::BadKey),
            self.count(Refusal::Shed),
        );
        let other = self.count(Refusal::Protocol) + self.count(Refusal::Left);
        tracing::warn!(
            "rendezvous refused {total} connection{} in all ({timed_out} timed out, {bad_key} \
             bad key, {shed} shed, {other} other)",
            if total == 1 { "" } else { "s" }
        );
    }
}

impl RendezvousServer {
    /// Bind `addr` (`host:port`; port 0 picks a free one) for a job of `size`
    /// ranks. A round that has begun but is not complete after `timeout`
    /// fails: the waiting ranks are told who is missing.
    ///
    /// # Errors
    /// [`Error::Os`] when the address cannot be bound, [`Error::Config`]
    /// for a size of 0.
    pub async fn bind(addr: &str, size: u32, job_key: JobKey, timeout: Duration) -> Result<Self> {
        Self::bind_from(addr, size, job_key, timeout, 0, None).await
    }

    pub(super) async fn bind_from(
        addr: &str,
        size: u32,
        key: JobKey,
        timeout: Duration,
        first_round: u32,
        last_round: Option<u32>,
    ) -> Result<Self> {
        if size == 0 {
            return Err(Error::Config("a rendezvous needs at least one rank".into()));
        }
        let listener = listen(addr)
            .await
            .map_err(|e| Error::os(format!("binding the rendezvous server to {addr}"), e))?;
        let shared = Arc::new(Shared {
            size,
            key,
            timeout,
            first_round,
            refused: Default::default(),
            reported: AtomicU64::new(0),
            warned: AtomicU32::new(0),
            state: Mutex::new(Round {
                number: first_round,
                ..Round::default()
            }),
            done: watch::channel(None).0,
            started: Notify::new(),
        });
        Ok(RendezvousServer {
            listener,
            shared,
            last_round,
        })
    }

    /// The address actually bound (with the real port when 0 was asked).
    ///
    /// # Errors
    /// [`Error::Os`] if the socket cannot report it.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|e| Error::os("reading the rendezvous server's address", e))
    }

    /// Connections refused so far.
    pub fn refused(&self) -> u64 {
        self.shared.count(Refusal::Any)
    }

    /// A handle to the counters that stays usable after [`serve`](Self::serve)
    /// took the server.
    pub fn stats(&self) -> ServerStats {
        ServerStats(self.shared.clone())
    }

    /// Serve rounds until the task is dropped (or, for rank 0's in-process
    /// server, until its one round is done).
    ///
    /// # Errors
    /// [`Error::Timeout`] naming the missing ranks when a round times out;
    /// [`Error::Os`] when accepting fails for another reason than a lack of
    /// descriptors or memory (after which it pauses and goes on).
    ///
    /// # Cancel safety
    /// Dropping the future closes the listener and every connection.
    pub async fn serve(self) -> Result<()> {
        let shared = self.shared;
        let cap = MIN_PENDING.max(shared.size as usize);
        let mut pending = Pending::default();
        let mut handshakes = JoinSet::new();
        let mut ranks = JoinSet::new();
        let mut done_rx = shared.done.subscribe();
        let mut paused: Option<Instant> = None;
        // Times accepting ran out of descriptors (the first is a warning).
        let mut starved = 0u64;
        let result = loop {
            let deadline = shared.lock().deadline;
            let expiry = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => shared.started.notified().await,
                }
            };
            let resume = async {
                match paused {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                accepted = self.listener.accept(), if paused.is_none() => match accepted {
                    Ok((stream, peer)) => {
                        if pending.len() >= cap {
                            pending.shed_oldest(
                                1,
                                Refusal::Shed,
                                "over the cap of connections still handshaking",
                            );
                        }
                        let task = handshakes.spawn(handshake(shared.clone(), stream, peer));
                        pending.add(task, peer);
                    }
                    Err(e) if out_of_resources(&e) => {
                        let n = pending.len().div_ceil(2);
                        let first = starved == 0;
                        starved += 1;
                        let pause = if n > 0 { ACCEPT_BACKOFF } else { STARVED_BACKOFF };
                        let what = format!(
                            "rendezvous cannot accept: {e}; closing {n} of {} connections still \
                             handshaking and pausing {pause:?} (raise `ulimit -n` if this is \
                             not an attack)",
                            pending.len()
                        );
                        if first {
                            tracing::warn!("{what}");
                        } else {
                            tracing::debug!("{what}");
                        }
                        pending.shed_oldest(n, Refusal::Shed, "accepting ran out of descriptors");
                        paused = Some(Instant::now() + pause);
                    }
                    Err(e) if is_transient(&e) => {
                        tracing::debug!("rendezvous accept failed, continuing: {e}");
                    }
                    Err(e) => break Err(Error::os("accepting rendezvous connections", e)),
                },
                () = resume => paused = None,
                () = expiry => {
                    if deadline.is_some() {
                        if let Some(err) = expire(&shared) {
                            break Err(err);
                        }
                    }
                }
                _ = done_rx.changed() => {
                    shared.report();
                    let finished = done_rx.borrow_and_update().as_ref().map(|(n, _)| *n);
                    if finished.is_some() && finished == self.last_round {
                        break Ok(());
                    }
                }
                Some(joined) = handshakes.join_next_with_id(), if !handshakes.is_empty() => {
                    match joined {
                        Ok((id, Some(joined))) => {
                            pending.remove(id);
                            ranks.spawn(serve_rank(shared.clone(), joined));
                        }
                        Ok((id, None)) => pending.remove(id),
                        Err(e) => pending.cancelled(&shared, e.id()),
                    }
                }
                Some(_) = ranks.join_next(), if !ranks.is_empty() => {}
            }
        };
        drop(self.listener);
        // Connections still handshaking are cut off; ranks that joined get
        // their answer.
        pending.shed_oldest(
            pending.len(),
            Refusal::TimedOut,
            "still handshaking when the rendezvous closed",
        );
        while let Some(joined) = handshakes.join_next_with_id().await {
            if let Err(e) = joined {
                pending.cancelled(&shared, e.id());
            }
        }
        if starved > 1 {
            tracing::warn!("rendezvous ran out of descriptors {starved} times while accepting");
        }
        shared.report();
        let _ = tokio::time::timeout(FLUSH_LIMIT, async {
            while ranks.join_next().await.is_some() {}
        })
        .await;
        result
    }
}

/// The unauthenticated connections, oldest first, and those being shed.
#[derive(Default)]
struct Pending {
    queue: VecDeque<(Id, AbortHandle, SocketAddr)>,
    /// Aborted, not yet collected: to count when their task ends cancelled
    /// (one that finished first is not counted).
    shed: HashMap<Id, (SocketAddr, Refusal, &'static str)>,
}

impl Pending {
    fn len(&self) -> usize {
        self.queue.len()
    }

    fn add(&mut self, task: AbortHandle, peer: SocketAddr) {
        self.queue.push_back((task.id(), task, peer));
    }

    fn remove(&mut self, id: Id) {
        if let Some(i) = self.queue.iter().position(|(t, ..)| *t == id) {
            self.queue.remove(i);
        }
        self.shed.remove(&id);
    }

    /// Abort the `n` oldest, to count as `kind` when their tasks end.
    fn shed_oldest(&mut self, n: usize, kind: Refusal, why: &'static str) {
        for (id, task, peer) in self.queue.drain(..n.min(self.queue.len())) {
            task.abort();
            self.shed.insert(id, (peer, kind, why));
        }
    }

    /// A handshake task ended by its abort.
    fn cancelled(&mut self, shared: &Shared, id: Id) {
        if let Some((peer, kind, why)) = self.shed.remove(&id) {
            shared.refuse(&peer.to_string(), kind, why);
        }
    }
}

/// Bind `addr` with a backlog that can queue a large job's ranks behind a
/// burst of strangers.
async fn listen(addr: &str) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let attempt = (|| {
            let s = Socket::new(Domain::for_address(a), Type::STREAM, Some(Protocol::TCP))?;
            s.set_reuse_address(true)?;
            s.set_nonblocking(true)?;
            s.bind(&a.into())?;
            s.listen(BACKLOG)?;
            TcpListener::from_std(s.into())
        })();
        match attempt {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the address resolves to nothing",
        )
    }))
}

/// Accept failed for lack of descriptors or kernel memory.
fn out_of_resources(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// Accept failed for this connection only.
fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), ConnectionAborted | ConnectionReset | Interrupted)
        || matches!(e.raw_os_error(), Some(libc::EPROTO | libc::EPERM))
}

/// Fail the current round if its deadline passed.
fn expire(shared: &Shared) -> Option<Error> {
    let mut round = shared.lock();
    match round.deadline {
        Some(d) if d <= Instant::now() => {}
        _ => return None,
    }
    let missing = shared.missing(&round);
    let number = round.number;
    *round = Round {
        number: number + 1,
        ..Round::default()
    };
    drop(round);
    tracing::error!(?missing, "rendezvous round {number} timed out");
    shared
        .done
        .send_replace(Some((number, Outcome::Missing(missing.clone()))));
    Some(Error::Timeout {
        what: format!("waiting for ranks {missing:?} to join rendezvous round {number}"),
        after: shared.timeout,
    })
}

/// Record a blob; completes the round when it was the last one.
fn deposit(
    shared: &Shared,
    rank: u32,
    round: u32,
    blob: Vec<u8>,
    peer: SocketAddr,
) -> std::result::Result<(), String> {
    let mut state = shared.lock();
    if state.number != round {
        return Err(format!("round {round} is no longer open"));
    }
    if let Some((_, first)) = state.blobs.get(&rank) {
        return Err(format!(
            "rank {rank} already joined round {round} from {first}: two processes hold the job \
             key and claim rank {rank}"
        ));
    }
    if state.blobs.is_empty() {
        state.deadline = Some(Instant::now() + shared.timeout);
        shared.started.notify_one();
    }
    state.blobs.insert(rank, (blob, peer));
    if state.blobs.len() as u64 == u64::from(shared.size) {
        let blobs = std::mem::take(&mut state.blobs)
            .into_values()
            .map(|(b, _)| b)
            .collect();
        *state = Round {
            number: round + 1,
            ..Round::default()
        };
        drop(state);
        shared
            .done
            .send_replace(Some((round, Outcome::All(Arc::new(blobs)))));
    }
    Ok(())
}

/// A connection whose join proved the job key.
struct Joined {
    stream: TcpStream,
    peer: SocketAddr,
    rank: u32,
    round: u32,
    /// Our proof of the key, sent once the server took the connection.
    proof: [u8; 32],
}

/// An authenticated rank: accept it, take its blob, wait for the round,
/// answer.
async fn serve_rank(shared: Arc<Shared>, joined: Joined) {
    let Joined {
        mut stream,
        peer,
        rank,
        round,
        proof,
    } = joined;
    let who = format!("rank {rank} at {peer}");
    let mut done_rx = shared.done.subscribe();
    if wire::write_frame(&mut stream, &ToClient::Accepted { proof })
        .await
        .is_err()
    {
        return;
    }
    let blob: ToServer = match wire::read_frame(&mut stream, wire::MAX_FRAME).await {
        Ok(msg) => msg,
        Err(e) => return tracing::warn!("rendezvous lost {who} before its blob: {e}"),
    };
    let ToServer::Blob(blob) = blob else {
        return shared.refuse(
            &who,
            Refusal::Protocol,
            "expected a blob after the handshake",
        );
    };
    if let Err(why) = deposit(&shared, rank, round, blob, peer) {
        shared.refuse(&who, Refusal::Protocol, &why);
        let _ = wire::write_frame(&mut stream, &ToClient::Refused { reason: why }).await;
        return;
    }
    let (mut rd, mut wr) = stream.split();
    loop {
        tokio::select! {
            outcome = wait_round(&mut done_rx, round) => {
                let msg = match outcome {
                    Some(Outcome::All(blobs)) => ToClient::All(blobs.as_ref().clone()),
                    Some(Outcome::Missing(missing)) => ToClient::Failed { missing },
                    None => return,
                };
                let _ = wire::write_frame(&mut wr, &msg).await;
                return;
            }
            query = wire::read_frame::<_, ToServer>(&mut rd, wire::MAX_HANDSHAKE) => match query {
                Ok(ToServer::Query) => {
                    let ranks = {
                        let state = shared.lock();
                        if state.number == round { shared.missing(&state) } else { Vec::new() }
                    };
                    if wire::write_frame(&mut wr, &ToClient::Missing { ranks }).await.is_err() {
                        return;
                    }
                }
                Ok(_) => {
                    return shared.refuse(&who, Refusal::Protocol, "unexpected message while waiting")
                }
                // The rank went away; its blob stays in the round.
                Err(_) => return,
            },
        }
    }
}

/// Wait for `round`'s outcome; `None` if the server is shutting down.
async fn wait_round(
    rx: &mut watch::Receiver<Option<(u32, Outcome)>>,
    round: u32,
) -> Option<Outcome> {
    let seen = rx
        .wait_for(|v| matches!(v, Some((n, _)) if *n >= round))
        .await
        .ok()?;
    match &*seen {
        Some((n, outcome)) if *n == round => Some(outcome.clone()),
        _ => None,
    }
}

/// The hint that goes with a wrong job key.
pub(crate) const SAME_KEY_HINT: &str = "every rank must be given the same BTL_JOB_KEY, or, \
     without one, read the same per-user secret file (a home directory shared by every node, or \
     the same BTL_SECRET_FILE)";

/// One unauthenticated connection, under [`HANDSHAKE_LIMIT`]: hello, join,
/// proof check. `Some` when it proved the key and belongs to the current
/// round; refusals are counted, logged and answered here.
async fn handshake(shared: Arc<Shared>, mut stream: TcpStream, peer: SocketAddr) -> Option<Joined> {
    let _ = stream.set_nodelay(true);
    let mut who = peer.to_string();
    let outcome = tokio::time::timeout(HANDSHAKE_LIMIT, async {
        let got = check_join(&shared, &mut stream, peer, &mut who).await;
        if let Err((_, why)) = &got {
            let reason = ToClient::Refused {
                reason: why.clone(),
            };
            let _ = wire::write_frame(&mut stream, &reason).await;
        }
        got
    })
    .await;
    match outcome {
        Ok(Ok(Some((rank, round, proof)))) => Some(Joined {
            stream,
            peer,
            rank,
            round,
            proof,
        }),
        Ok(Ok(None)) => None,
        Ok(Err((kind, why))) => {
            shared.refuse(&who, kind, &why);
            None
        }
        Err(_) => {
            let why = format!("no join within {HANDSHAKE_LIMIT:?}");
            shared.refuse(&who, Refusal::TimedOut, &why);
            None
        }
    }
}

/// Hello, Join, proof check: the rank, its round and our proof of the key
/// for a join that proved it. `Ok(None)`: the client must retry (an early
/// rank of the next round). `who` becomes "rank R at ADDR" once the join
/// names a rank.
async fn check_join(
    shared: &Shared,
    stream: &mut TcpStream,
    peer: SocketAddr,
    who: &mut String,
) -> std::result::Result<Option<(u32, u32, [u8; 32])>, (Refusal, String)> {
    let mut nonce_s = [0u8; 32];
    rand::rng().fill_bytes(&mut nonce_s);
    let hello = ToClient::Hello {
        version: wire::VERSION,
        nonce: nonce_s,
    };
    if let Err(e) = wire::write_frame(stream, &hello).await {
        return Err((Refusal::Left, format!("gone before our hello: {e}")));
    }
    let join = match wire::read_frame(stream, wire::MAX_HANDSHAKE).await {
        Ok(join) => join,
        Err(e @ (FrameError::Eof | FrameError::Io(_))) => {
            return Err((Refusal::Left, format!("gone before its join: {e}")))
        }
        Err(e) => return Err((Refusal::Protocol, format!("bad join message: {e}"))),
    };
    let ToServer::Join {
        version,
        rank,
        size,
        round,
        nonce,
        proof,
    } = join
    else {
        return Err((Refusal::Protocol, "the first message was not a join".into()));
    };
    if version != wire::VERSION {
        return Err((
            Refusal::Protocol,
            format!(
                "protocol version {version}, server speaks {}: run the same async-btl on every \
                 rank",
                wire::VERSION
            ),
        ));
    }
    *who = format!("rank {rank} at {peer}");
    let expected = wire::join_proof(&shared.key, &nonce_s, &nonce, rank, size, round);
    if !super::key::ct_eq(&expected, &proof) {
        return Err((
            Refusal::BadKey,
            format!("it presented a wrong job key: {SAME_KEY_HINT}"),
        ));
    }
    if size != shared.size || rank >= size {
        return Err((
            Refusal::Protocol,
            format!(
                "rank {rank} of {size} does not fit this job of {} ranks",
                shared.size
            ),
        ));
    }
    let current = shared.lock().number;
    if round > current {
        // An early rank of the next round: come back when this one is over.
        let _ = wire::write_frame(stream, &ToClient::Retry).await;
        return Ok(None);
    }
    if round < current {
        return Err((
            Refusal::Protocol,
            format!("round {round} is over (now at round {current})"),
        ));
    }
    // `Accepted` is written by the rank's task, where shedding cannot cut
    // it off half-sent.
    let proof = wire::accept_proof(&shared.key, &nonce, &nonce_s, rank, round);
    Ok(Some((rank, round, proof)))
}

//! The TCP rendezvous server, run in-process by rank 0 or by `btl-run`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rand::RngCore;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::wire::{self, FrameError, ToClient, ToServer};
use super::JobKey;
use crate::{Error, Result};

/// How long an unauthenticated connection may take to present its join.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);
/// How long a finished server waits for its last answers to be written.
const FLUSH_LIMIT: Duration = Duration::from_secs(5);

/// A TCP rendezvous server for one job.
///
/// It serves [`all_gather`](super::all_gather) rounds one after the other:
/// a round completes when all `size` ranks have joined, and then every rank
/// gets all blobs. Every connection must prove it holds the job key; the
/// others are refused, counted ([`ServerStats::refused`]) and logged.
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
#[derive(Debug, Clone)]
pub struct ServerStats(Arc<Shared>);

impl ServerStats {
    /// Connections refused: wrong job key, bad protocol, rank out of range,
    /// wrong job size, stale round or duplicate rank.
    pub fn refused(&self) -> u64 {
        self.0.refused.load(Ordering::Relaxed)
    }

    /// Rounds finished so far, completed or failed by the timeout.
    pub fn rounds_finished(&self) -> u32 {
        self.0.lock().number - self.0.first_round
    }
}

#[derive(Debug)]
struct Shared {
    size: u32,
    key: JobKey,
    timeout: Duration,
    first_round: u32,
    refused: AtomicU64,
    state: Mutex<Round>,
    /// Published when a round ends: (round, outcome).
    done: watch::Sender<Option<(u32, Outcome)>>,
    /// Rung when a round gets its first join (its deadline starts).
    started: Notify,
}

#[derive(Debug, Default)]
struct Round {
    number: u32,
    blobs: BTreeMap<u32, Vec<u8>>,
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

    fn refuse(&self, peer: SocketAddr, why: &str) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(%peer, "rendezvous refused a connection: {why}");
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
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::os(format!("binding the rendezvous server to {addr}"), e))?;
        let shared = Arc::new(Shared {
            size,
            key,
            timeout,
            first_round,
            refused: AtomicU64::new(0),
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
        self.shared.refused.load(Ordering::Relaxed)
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
    /// [`Error::Os`] when accepting fails.
    ///
    /// # Cancel safety
    /// Dropping the future closes the listener and every connection.
    pub async fn serve(self) -> Result<()> {
        let shared = self.shared;
        let mut conns = JoinSet::new();
        let mut done_rx = shared.done.subscribe();
        let result = loop {
            let deadline = shared.lock().deadline;
            let expiry = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => shared.started.notified().await,
                }
            };
            tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        conns.spawn(handle(shared.clone(), stream, peer));
                    }
                    Err(e) if is_transient(&e) => {
                        tracing::warn!("rendezvous accept failed, continuing: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(e) => break Err(Error::os("accepting rendezvous connections", e)),
                },
                () = expiry => {
                    if deadline.is_some() {
                        if let Some(err) = expire(&shared) {
                            break Err(err);
                        }
                    }
                }
                _ = done_rx.changed() => {
                    let finished = done_rx.borrow_and_update().as_ref().map(|(n, _)| *n);
                    if finished.is_some() && finished == self.last_round {
                        break Ok(());
                    }
                }
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        };
        drop(self.listener);
        // Let the handlers deliver the last outcome before returning.
        let _ = tokio::time::timeout(FLUSH_LIMIT, async {
            while conns.join_next().await.is_some() {}
        })
        .await;
        result
    }
}

fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), ConnectionAborted | ConnectionReset | Interrupted)
        || matches!(
            e.raw_os_error(),
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
        )
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
) -> std::result::Result<(), String> {
    let mut state = shared.lock();
    if state.number != round {
        return Err(format!("round {round} is no longer open"));
    }
    if state.blobs.contains_key(&rank) {
        return Err(format!("rank {rank} joined round {round} twice"));
    }
    if state.blobs.is_empty() {
        state.deadline = Some(Instant::now() + shared.timeout);
        shared.started.notify_one();
    }
    state.blobs.insert(rank, blob);
    if state.blobs.len() as u64 == u64::from(shared.size) {
        let blobs = std::mem::take(&mut state.blobs).into_values().collect();
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

/// One connection: handshake, blob, wait for the round, answer.
async fn handle(shared: Arc<Shared>, mut stream: TcpStream, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    let mut done_rx = shared.done.subscribe();
    let (rank, round) =
        match tokio::time::timeout(HANDSHAKE_LIMIT, handshake(&shared, &mut stream)).await {
            Ok(Ok(Some(joined))) => joined,
            Ok(Ok(None)) => return,
            Ok(Err(why)) => {
                shared.refuse(peer, &why);
                let reason = ToClient::Refused { reason: why };
                let _ = wire::write_frame(&mut stream, &reason).await;
                return;
            }
            Err(_) => return shared.refuse(peer, "no join within the handshake limit"),
        };
    let blob: ToServer = match wire::read_frame(&mut stream, wire::MAX_FRAME).await {
        Ok(msg) => msg,
        Err(e) => return tracing::warn!(%peer, rank, "rendezvous lost a rank before its blob: {e}"),
    };
    let ToServer::Blob(blob) = blob else {
        return shared.refuse(peer, "expected a blob after the handshake");
    };
    if let Err(why) = deposit(&shared, rank, round, blob) {
        shared.refuse(peer, &why);
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
                Ok(_) => return shared.refuse(peer, "unexpected message while waiting"),
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

/// Hello, Join, proof check. `Ok(None)`: the client left or must retry.
async fn handshake(
    shared: &Shared,
    stream: &mut TcpStream,
) -> std::result::Result<Option<(u32, u32)>, String> {
    let mut nonce_s = [0u8; 32];
    rand::rng().fill_bytes(&mut nonce_s);
    let hello = ToClient::Hello {
        version: wire::VERSION,
        nonce: nonce_s,
    };
    if wire::write_frame(stream, &hello).await.is_err() {
        return Ok(None);
    }
    let join = match wire::read_frame(stream, wire::MAX_HANDSHAKE).await {
        Ok(join) => join,
        Err(FrameError::Eof) | Err(FrameError::Io(_)) => return Ok(None),
        Err(e) => return Err(format!("bad join message: {e}")),
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
        return Err("the first message was not a join".into());
    };
    if version != wire::VERSION {
        return Err(format!(
            "protocol version {version}, server speaks {}: run the same async-btl on every rank",
            wire::VERSION
        ));
    }
    let expected = wire::join_proof(&shared.key, &nonce_s, &nonce, rank, size, round);
    if !super::key::ct_eq(&expected, &proof) {
        return Err("wrong job key: every rank must be given the same BTL_JOB_KEY".into());
    }
    if size != shared.size || rank >= size {
        return Err(format!(
            "rank {rank} of {size} does not fit this job of {} ranks",
            shared.size
        ));
    }
    let current = shared.lock().number;
    let reply = if round > current {
        // An early rank of the next round: come back when this one is over.
        ToClient::Retry
    } else if round < current {
        return Err(format!("round {round} is over (now at round {current})"));
    } else {
        ToClient::Accepted {
            proof: wire::accept_proof(&shared.key, &nonce, &nonce_s, rank, round),
        }
    };
    let retry = matches!(reply, ToClient::Retry);
    if wire::write_frame(stream, &reply).await.is_err() || retry {
        return Ok(None);
    }
    Ok(Some((rank, round)))
}

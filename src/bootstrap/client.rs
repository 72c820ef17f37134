//! The rank side of the TCP rendezvous.

use std::time::Duration;

use rand::RngCore;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::server::RendezvousServer;
use super::wire::{self, FrameError, ToClient, ToServer};
use super::{Host, JobInfo};
use crate::{Error, Result};

/// How long to wait for the server's answer to a `Query` after our deadline.
const QUERY_GRACE: Duration = Duration::from_secs(2);

/// Run one all-gather round over TCP; rank 0 also serves it when it hosts.
pub(super) async fn gather(
    job: &JobInfo,
    round: u32,
    addr: &str,
    host: Host,
    mine: Vec<u8>,
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    let deadline = Instant::now() + timeout;
    if host == Host::Launcher || job.rank != 0 {
        return exchange(job, round, addr, host, mine, timeout, deadline).await;
    }
    let server = bind_rank0(job, addr, round, timeout).await?;
    let mut target = server.local_addr()?;
    if target.ip().is_unspecified() {
        target.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let stats = server.stats();
    let mut serving = tokio::spawn(server.serve());
    let result = exchange(
        job,
        round,
        &target.to_string(),
        host,
        mine,
        timeout,
        deadline,
    )
    .await;
    // Wait for the server to answer everyone, so the port is free for the
    // next round. After a failure, give it a moment to tell the waiting
    // ranks who is missing. A server error is reported if ours went through.
    let served = match result {
        Ok(_) => serving.await,
        Err(_) => match tokio::time::timeout(QUERY_GRACE, &mut serving).await {
            Ok(served) => served,
            Err(_) => {
                serving.abort();
                Ok(Ok(()))
            }
        },
    };
    job.refused
        .fetch_add(stats.refused(), std::sync::atomic::Ordering::Relaxed);
    match served {
        Ok(Err(e)) if result.is_ok() => Err(e),
        _ => result,
    }
}

/// Bind rank 0's server to `addr`; fall back to all interfaces when the
/// host name does not belong to a local interface.
async fn bind_rank0(
    job: &JobInfo,
    addr: &str,
    round: u32,
    timeout: Duration,
) -> Result<RendezvousServer> {
    let key = job.job_key.clone();
    let size = job.size;
    match RendezvousServer::bind_from(addr, size, key.clone(), timeout, round, Some(round)).await {
        Err(Error::Os { source, .. }) if source.raw_os_error() == Some(libc::EADDRNOTAVAIL) => {
            let port = super::spec::split_host_port(addr).map_or(0, |(_, p)| p);
            tracing::warn!(
                addr,
                "rank 0 cannot bind the rendezvous host; listening on 0.0.0.0:{port}"
            );
            let any = format!("0.0.0.0:{port}");
            RendezvousServer::bind_from(&any, size, key, timeout, round, Some(round)).await
        }
        other => other,
    }
}

/// Connect (with retries), join, send the blob and wait for everyone.
async fn exchange(
    job: &JobInfo,
    round: u32,
    addr: &str,
    host: Host,
    mine: Vec<u8>,
    timeout: Duration,
    deadline: Instant,
) -> Result<Vec<Vec<u8>>> {
    let mut stream = connect_and_join(job, round, addr, host, timeout, deadline).await?;
    let lost = |e: FrameError| {
        Error::Bootstrap(format!(
            "the rendezvous at {addr} went away before all ranks joined ({e}); is {} still running?",
            server_name(host)
        ))
    };
    wire::write_frame(&mut stream, &ToServer::Blob(mine))
        .await
        .map_err(|e| lost(FrameError::Io(e)))?;
    let reply =
        match tokio::time::timeout_at(deadline, wire::read_frame(&mut stream, wire::MAX_FRAME))
            .await
        {
            Ok(reply) => reply.map_err(lost)?,
            Err(_) => {
                // Our time is up: ask the server who is missing, to say so.
                wire::write_frame(&mut stream, &ToServer::Query)
                    .await
                    .map_err(|e| lost(FrameError::Io(e)))?;
                let answer = async {
                    loop {
                        match wire::read_frame(&mut stream, wire::MAX_FRAME).await? {
                            // The round just ended: its outcome follows.
                            ToClient::Missing { ranks } if ranks.is_empty() => continue,
                            other => return Ok(other),
                        }
                    }
                };
                tokio::time::timeout(QUERY_GRACE, answer)
                    .await
                    .map_err(|_| Error::Timeout {
                        what: format!("waiting for the other ranks at the rendezvous {addr}"),
                        after: timeout,
                    })?
                    .map_err(lost)?
            }
        };
    match reply {
        ToClient::All(blobs) if blobs.len() as u64 == u64::from(job.size) => Ok(blobs),
        ToClient::All(blobs) => Err(Error::Bootstrap(format!(
            "the rendezvous at {addr} returned {} blobs for a job of {} ranks",
            blobs.len(),
            job.size
        ))),
        ToClient::Missing { ranks } | ToClient::Failed { missing: ranks } => Err(Error::Timeout {
            what: format!("waiting for ranks {ranks:?} to join the all-gather at tcp:{addr} (they did not start, crashed, or have another job key)"),
            after: timeout,
        }),
        other => Err(Error::Bootstrap(format!(
            "the rendezvous at {addr} sent an unexpected {other:?}"
        ))),
    }
}

fn server_name(host: Host) -> &'static str {
    match host {
        Host::Rank0 => "rank 0",
        Host::Launcher => "the launcher",
    }
}

/// Connect until accepted or the deadline passes.
async fn connect_and_join(
    job: &JobInfo,
    round: u32,
    addr: &str,
    host: Host,
    timeout: Duration,
    deadline: Instant,
) -> Result<TcpStream> {
    let mut pause = Duration::from_millis(5);
    let mut last = String::from("never tried");
    loop {
        let attempt = tokio::time::timeout_at(deadline, try_join(job, round, addr)).await;
        match attempt {
            Ok(Ok(Some(stream))) => return Ok(stream),
            Ok(Ok(None)) => {
                last = "the server asked us to retry (previous round still open)".into()
            }
            Ok(Err(Attempt::Fatal(e))) => return Err(e),
            Ok(Err(Attempt::Again(why))) => last = why,
            Err(_) => {}
        }
        if Instant::now() + pause >= deadline {
            let who = match host {
                Host::Rank0 => "ranks [0] did not open the rendezvous",
                Host::Launcher => "the launcher's rendezvous is unreachable",
            };
            return Err(Error::Timeout {
                what: format!(
                    "connecting to the rendezvous at {addr}: {who} (last attempt: {last})"
                ),
                after: timeout,
            });
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

enum Attempt {
    /// Worth retrying (server not up yet, connection reset...).
    Again(String),
    /// Retrying will not help.
    Fatal(Error),
}

/// One connection attempt: `Ok(None)` means "retry", the server is busy.
async fn try_join(
    job: &JobInfo,
    round: u32,
    addr: &str,
) -> std::result::Result<Option<TcpStream>, Attempt> {
    let again = |what: &str, e: &dyn std::fmt::Display| Attempt::Again(format!("{what}: {e}"));
    let mut stream = TcpStream::connect(addr)
        .await
        .map_err(|e| again("connect", &e))?;
    let _ = stream.set_nodelay(true);
    let not_ours = |e: &dyn std::fmt::Display| {
        Attempt::Fatal(Error::Bootstrap(format!(
            "{addr} does not speak the async-btl rendezvous protocol ({e}); check BTL_RENDEZVOUS"
        )))
    };
    let hello = match wire::read_frame(&mut stream, wire::MAX_HANDSHAKE).await {
        Ok(hello) => hello,
        Err(FrameError::Malformed(m)) => return Err(not_ours(&m)),
        Err(e) => return Err(again("reading the server's hello", &e)),
    };
    let ToClient::Hello {
        version,
        nonce: nonce_s,
    } = hello
    else {
        return Err(not_ours(&"no hello"));
    };
    if version != wire::VERSION {
        return Err(Attempt::Fatal(Error::Bootstrap(format!(
            "the rendezvous at {addr} speaks protocol {version}, we speak {}: run the same async-btl version on every rank",
            wire::VERSION
        ))));
    }
    let mut nonce = [0u8; 32];
    rand::rng().fill_bytes(&mut nonce);
    let key = &job.job_key;
    let proof = wire::join_proof(key, &nonce_s, &nonce, job.rank, job.size, round);
    let join = ToServer::Join {
        version,
        rank: job.rank,
        size: job.size,
        round,
        nonce,
        proof,
    };
    wire::write_frame(&mut stream, &join)
        .await
        .map_err(|e| again("sending our join", &e))?;
    match wire::read_frame(&mut stream, wire::MAX_HANDSHAKE).await {
        Ok(ToClient::Accepted { proof }) => {
            let expected = wire::accept_proof(key, &nonce, &nonce_s, job.rank, round);
            if super::key::ct_eq(&expected, &proof) {
                Ok(Some(stream))
            } else {
                Err(Attempt::Fatal(Error::Bootstrap(format!(
                    "the rendezvous at {addr} could not prove it holds our job key: it belongs \
                     to another job, or {}",
                    super::server::SAME_KEY_HINT
                ))))
            }
        }
        Ok(ToClient::Retry) => Ok(None),
        Ok(ToClient::Refused { reason }) => Err(Attempt::Fatal(Error::Bootstrap(format!(
            "the rendezvous at {addr} refused rank {}: {reason}",
            job.rank
        )))),
        Ok(other) => Err(not_ours(&format!("unexpected {other:?}"))),
        Err(FrameError::Malformed(m)) => Err(not_ours(&m)),
        Err(e) => Err(again("waiting for the server's answer", &e)),
    }
}

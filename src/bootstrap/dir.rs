//! The directory rendezvous: one file per rank in a private directory.

use std::fs::{self, DirBuilder, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::{current_uid, JobInfo};
use crate::{Error, Result};

/// What each rank writes to `g<round>-rank-<r>`.
#[derive(Serialize, Deserialize)]
struct Entry {
    version: u32,
    rank: u32,
    size: u32,
    round: u32,
    /// HMAC over ("dir", rank, size, round, blob) with the job key.
    mac: [u8; 32],
    blob: Vec<u8>,
}

const VERSION: u32 = 1;

fn entry_mac(job: &JobInfo, rank: u32, round: u32, blob: &[u8]) -> [u8; 32] {
    let (r, s, n) = (
        rank.to_le_bytes(),
        job.size.to_le_bytes(),
        round.to_le_bytes(),
    );
    job.job_key.mac(&[b"dir", &r, &s, &n, blob])
}

/// Our entry for `round`, carrying `blob`.
pub(crate) fn encode_entry(job: &JobInfo, round: u32, blob: Vec<u8>) -> Result<Vec<u8>> {
    let entry = Entry {
        version: VERSION,
        rank: job.rank,
        size: job.size,
        round,
        mac: entry_mac(job, job.rank, round, &blob),
        blob,
    };
    postcard::to_allocvec(&entry)
        .map_err(|e| Error::Bootstrap(format!("encoding our rendezvous entry: {e}")))
}

/// Run one all-gather round through `dir`.
pub(super) async fn gather(
    job: &JobInfo,
    round: u32,
    dir: &Path,
    mine: Vec<u8>,
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    let deadline = Instant::now() + timeout;
    let bytes = encode_entry(job, round, mine)?;
    let name = format!("g{round}-rank-{}", job.rank);
    // Small files, written and read on the calling thread (no fsync):
    // a single-threaded rank stays one (see `Liveness::Inline`).
    write_atomic(dir, &name, &bytes)?;

    let mut blobs: Vec<Option<Vec<u8>>> = vec![None; job.size as usize];
    let mut pause = Duration::from_millis(2);
    loop {
        for rank in 0..job.size {
            if blobs[rank as usize].is_none() {
                blobs[rank as usize] = read_entry(job, dir, round, rank)?;
            }
        }
        let missing: Vec<u32> = (0..job.size)
            .filter(|r| blobs[*r as usize].is_none())
            .collect();
        if missing.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: format!(
                    "waiting for ranks {missing:?} to join the all-gather in {} (they did not \
                     start, crashed, or use another directory)",
                    dir.display()
                ),
                after: timeout,
            });
        }
        tokio::time::sleep(pause.min(deadline - Instant::now())).await;
        pause = (pause * 2).min(Duration::from_millis(50));
    }
    finish_round(dir, round, job.rank, job.size)?;
    Ok(blobs.into_iter().flatten().collect())
}

/// Create `dir` (0700) and check that we own it and others cannot write it.
/// A parent named `async-btl-<uid>` (the default layout) is checked too.
fn prepare_dir(dir: &Path) -> Result<()> {
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| {
            Error::os(
                format!("creating the rendezvous directory {}", dir.display()),
                e,
            )
        })?;
    let uid = current_uid();
    let mut check = vec![dir];
    if let Some(parent) = dir.parent() {
        if parent.file_name().and_then(|n| n.to_str()) == Some(&format!("async-btl-{uid}")) {
            check.push(parent);
        }
    }
    for d in check {
        let meta = fs::symlink_metadata(d)
            .map_err(|e| Error::os(format!("checking {}", d.display()), e))?;
        if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o022 != 0 {
            return Err(Error::Bootstrap(format!(
                "the rendezvous directory {} is not a private directory of uid {uid} (owner \
                 {}, mode {:o}); remove it or choose another with BTL_RENDEZVOUS=dir:/path",
                d.display(),
                meta.uid(),
                meta.mode() & 0o7777
            )));
        }
    }
    Ok(())
}

/// Write `bytes` to `dir/name` through a temporary file and a rename, so
/// readers see all of it or nothing. Retries if another rank removed the
/// (then empty) directory in between.
fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(format!(".tmp-{name}-{}", std::process::id()));
    let mut tries = 0;
    loop {
        prepare_dir(dir)?;
        let written = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(bytes))
            .and_then(|()| fs::rename(&tmp, dir.join(name)));
        match written {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound && tries < 3 => tries += 1,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(Error::os(
                    format!("writing {}", dir.join(name).display()),
                    e,
                ));
            }
        }
    }
}

/// Read and check rank `rank`'s entry; `None` while it is not there yet.
fn read_entry(job: &JobInfo, dir: &Path, round: u32, rank: u32) -> Result<Option<Vec<u8>>> {
    let path: PathBuf = dir.join(format!("g{round}-rank-{rank}"));
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::os(format!("reading {}", path.display()), e)),
    };
    decode_entry(job, round, rank, &bytes, &path).map(Some)
}

/// Check rank `rank`'s entry for `round` (read from `path`, named in the
/// errors) and return its blob.
pub(crate) fn decode_entry(
    job: &JobInfo,
    round: u32,
    rank: u32,
    bytes: &[u8],
    path: &Path,
) -> Result<Vec<u8>> {
    let bad = |why: &str| {
        Err(Error::Bootstrap(format!(
            "{} {why}: another job is using this directory or the ranks were given different \
             BTL_JOB_KEYs; remove it or set BTL_RENDEZVOUS=dir:/another/path",
            path.display()
        )))
    };
    let entry: Entry = match postcard::from_bytes(bytes) {
        Ok(e) => e,
        Err(_) => return bad("is not a rendezvous entry of this async-btl version"),
    };
    if entry.version != VERSION
        || entry.rank != rank
        || entry.size != job.size
        || entry.round != round
    {
        return bad("belongs to another job layout (version, rank, size or round differ)");
    }
    let mac = entry_mac(job, rank, round, &entry.blob);
    if !super::key::ct_eq(&mac, &entry.mac) {
        return bad("carries another job key");
    }
    Ok(entry.blob)
}

/// Mark this rank done; the rank that sees every marker removes the
/// round's files, then the directory if nothing else is in it.
fn finish_round(dir: &Path, round: u32, rank: u32, size: u32) -> Result<()> {
    write_atomic(dir, &format!("g{round}-done-{rank}"), &[])?;
    let all_done = (0..size).all(|r| dir.join(format!("g{round}-done-{r}")).exists());
    if !all_done {
        return Ok(());
    }
    for r in 0..size {
        for kind in ["rank", "done"] {
            match fs::remove_file(dir.join(format!("g{round}-{kind}-{r}"))) {
                Err(e) if e.kind() != ErrorKind::NotFound => {
                    tracing::warn!("cleaning the rendezvous directory {}: {e}", dir.display());
                }
                _ => {}
            }
        }
    }
    // Fails harmlessly while another round's files (or a stranger's) remain.
    let _ = fs::remove_dir(dir);
    Ok(())
}

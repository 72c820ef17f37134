//! Where the ranks meet to exchange their addresses.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Who runs the TCP rendezvous server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Host {
    /// Rank 0 binds the address and serves the exchange in-process.
    Rank0,
    /// The launcher (e.g. `btl-run`) already serves it; every rank, rank 0
    /// included, only connects.
    Launcher,
}

/// How the ranks of a job find each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RendezvousSpec {
    /// A TCP server at `addr` (`host:port`).
    Tcp {
        /// `host:port` of the server.
        addr: String,
        /// Who runs the server.
        hosted_by: Host,
    },
    /// A directory every rank can read and write (node-local or shared
    /// file system). Created with mode 0700 if missing; removed after a
    /// successful exchange.
    Dir(PathBuf),
}

impl RendezvousSpec {
    /// Parse the `BTL_RENDEZVOUS` syntax: `tcp:HOST:PORT` or `dir:/path`.
    ///
    /// `hosted_by` comes from `BTL_RENDEZVOUS_HOST` and only matters for
    /// `tcp:`. An IPv6 host is written in brackets: `tcp:[::1]:4000`.
    ///
    /// # Errors
    /// [`Error::Config`] naming `var` when the text does not parse.
    pub fn parse(text: &str, hosted_by: Host, var: &str) -> Result<Self> {
        if let Some(addr) = text.strip_prefix("tcp:") {
            check_host_port(addr).map_err(|why| {
                Error::Config(format!(
                    "{var}={text:?}: {why}; expected tcp:HOST:PORT, e.g. tcp:127.0.0.1:29400"
                ))
            })?;
            Ok(RendezvousSpec::Tcp {
                addr: addr.to_string(),
                hosted_by,
            })
        } else if let Some(path) = text.strip_prefix("dir:") {
            if !Path::new(path).is_absolute() {
                return Err(Error::Config(format!(
                    "{var}={text:?}: the directory must be an absolute path, e.g. dir:/tmp/my-job"
                )));
            }
            Ok(RendezvousSpec::Dir(PathBuf::from(path)))
        } else {
            Err(Error::Config(format!(
                "{var}={text:?}: expected tcp:HOST:PORT or dir:/absolute/path"
            )))
        }
    }

    /// The per-job directory used on a single node when the launcher gives
    /// no rendezvous: `$TMPDIR/async-btl-<uid>/<job_id>` (`/tmp` when
    /// `TMPDIR` is unset).
    pub fn default_dir(tmpdir: Option<&str>, uid: u32, job_id: &str) -> Result<Self> {
        let base = match tmpdir {
            Some(t) if !t.is_empty() => PathBuf::from(t),
            _ => PathBuf::from("/tmp"),
        };
        let leaf = sanitize(job_id);
        if leaf.is_empty() {
            return Err(Error::Config(
                "the job id is empty; set BTL_JOB_ID or BTL_RENDEZVOUS".into(),
            ));
        }
        Ok(RendezvousSpec::Dir(
            base.join(format!("async-btl-{uid}")).join(leaf),
        ))
    }
}

impl fmt::Display for RendezvousSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RendezvousSpec::Tcp { addr, .. } => write!(f, "tcp:{addr}"),
            RendezvousSpec::Dir(p) => write!(f, "dir:{}", p.display()),
        }
    }
}

/// Parse `BTL_RENDEZVOUS_HOST`: `rank0` (the default) or `launcher`.
pub(crate) fn parse_host(text: Option<&str>) -> Result<Host> {
    match text.map(str::trim) {
        None | Some("") | Some("rank0") => Ok(Host::Rank0),
        Some("launcher") => Ok(Host::Launcher),
        Some(other) => Err(Error::Config(format!(
            "BTL_RENDEZVOUS_HOST={other:?}: expected rank0 or launcher"
        ))),
    }
}

/// Split `host:port` (IPv6 in brackets) and check the port.
pub(crate) fn split_host_port(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = match host.strip_prefix('[') {
        Some(inner) => inner.strip_suffix(']')?,
        None if host.contains(':') => return None,
        None => host,
    };
    if host.is_empty() {
        return None;
    }
    Some((host, port.parse().ok()?))
}

fn check_host_port(addr: &str) -> std::result::Result<(), &'static str> {
    match split_host_port(addr) {
        Some(_) => Ok(()),
        None => Err("not a HOST:PORT pair with a port in 0..=65535"),
    }
}

/// Keep a job id usable as one path component.
fn sanitize(job_id: &str) -> String {
    job_id
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '-' | '_' => c,
            _ => '_',
        })
        .collect::<String>()
        .trim_start_matches('.')
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tcp_and_dir() {
        let s = RendezvousSpec::parse("tcp:127.0.0.1:4000", Host::Launcher, "V").unwrap();
        assert_eq!(
            s,
            RendezvousSpec::Tcp {
                addr: "127.0.0.1:4000".into(),
                hosted_by: Host::Launcher
            }
        );
        assert!(RendezvousSpec::parse("tcp:[::1]:4000", Host::Rank0, "V").is_ok());
        let d = RendezvousSpec::parse("dir:/tmp/x", Host::Rank0, "V").unwrap();
        assert_eq!(d, RendezvousSpec::Dir("/tmp/x".into()));
        assert_eq!(d.to_string(), "dir:/tmp/x");
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "tcp:host",
            "tcp::80",
            "tcp:h:99999",
            "tcp:::1:80",
            "dir:relative",
            "udp:x:1",
            "",
        ] {
            let e = RendezvousSpec::parse(bad, Host::Rank0, "BTL_RENDEZVOUS").unwrap_err();
            assert!(e.to_string().contains("BTL_RENDEZVOUS"), "{e}");
        }
    }

    #[test]
    fn default_dir_is_per_user_and_job() {
        let d = RendezvousSpec::default_dir(None, 1000, "ns/1:2").unwrap();
        assert_eq!(d, RendezvousSpec::Dir("/tmp/async-btl-1000/ns_1_2".into()));
        let d = RendezvousSpec::default_dir(Some("/scratch"), 5, "..").unwrap_err();
        assert!(matches!(d, Error::Config(_)));
    }

    #[test]
    fn host_values() {
        assert_eq!(parse_host(None).unwrap(), Host::Rank0);
        assert_eq!(parse_host(Some("launcher")).unwrap(), Host::Launcher);
        assert!(parse_host(Some("rank1")).is_err());
    }
}

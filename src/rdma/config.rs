//! `rdma`'s settings: the provider, the address to bind, the eager size,
//! credits and the peer timeout. Read from `BTL_RDMA_*` variables by
//! [`crate::Config`]; present in every build (a build without the `rdma`
//! feature reads and checks them, and never opens the transport).

use std::time::Duration;

use crate::sys::env::{parse, switch};
use crate::{Error, Result};

/// Settings of the `rdma` transport (`Config::rdma`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaConfig {
    /// The libfabric provider, as `fi_info` names it (`verbs;ofi_rxm`,
    /// `efa`, `tcp;ofi_rxm`). Default: the best one found, hardware
    /// first and `tcp;ofi_rxm` last; never `shm` (same-node peers use
    /// `sm`). Env: `BTL_RDMA_PROVIDER`.
    pub provider: Option<String>,
    /// The address of this host to bind the provider to (an interface's
    /// IP address, `127.0.0.1` for a job on one host). Default: the
    /// provider's choice. Env: `BTL_RDMA_ADDR`.
    pub addr: Option<String>,
    /// Largest frame sent eagerly into the receiver's pre-posted buffers:
    /// a message and the transport's 32-byte header. Larger messages go in
    /// two frames, or by rendezvous, read by the receiver with RDMA read.
    /// Default 16 KiB + 32 B, so a 16 KiB message goes in one frame. Over
    /// `ofi_rxm` this is also rxm's own eager limit and buffer size
    /// (`FI_OFI_RXM_EAGER_LIMIT`, `FI_OFI_RXM_BUFFER_SIZE`, set to it
    /// unless the user set them, before libfabric starts): a frame above
    /// rxm's limit would take its segmented or rendezvous path, the
    /// slowest of all, so where the user's rxm limit is lower, frames are
    /// kept within it. All ranks must agree on it. Env: `BTL_RDMA_EAGER`.
    pub eager: usize,
    /// Eager buffers each sender may fill at a receiver before the
    /// receiver returns credits (a receiver that does not read holds its
    /// senders back). Default 128: more than a window of a streaming
    /// sender (OSU's bandwidth test keeps 64 in flight), so a sender waits
    /// for credits only when its receiver falls behind. Env:
    /// `BTL_RDMA_CREDITS`.
    pub credits: u32,
    /// A peer not heard from for this long is lost and everything pending
    /// on it fails (every peer hears from us at least every quarter of
    /// it). Default 5 s, as udp's. Env: `BTL_RDMA_PEER_TIMEOUT_MS`.
    pub peer_timeout: Duration,
    /// Gather small messages to one peer and tag (up to 4 KiB each) into
    /// one frame while a send to that peer is still in flight (on by
    /// default; a bundle opens only with credits in hand and nothing
    /// queued, so a receiver that returns no credits still holds its
    /// sender back): a stream of small messages then costs the
    /// provider one send, and the receiver one completion, per frame
    /// rather than per message. A message that finds nothing in flight
    /// leaves at once, so latency is unchanged. Off, every message is a
    /// frame of its own. Env: `BTL_RDMA_BUNDLE` (`1`/`on`, `0`/`off`).
    pub bundle: bool,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            provider: None,
            addr: None,
            eager: (16 << 10) + crate::rdma::wire::HEADER,
            credits: 128,
            peer_timeout: Duration::from_secs(5),
            bundle: true,
        }
    }
}

/// Smallest eager buffer: a header and a little data.
pub(crate) const MIN_EAGER: usize = 256;
/// Largest eager buffer.
const MAX_EAGER: usize = 1 << 20;

impl RdmaConfig {
    /// Override from the `BTL_RDMA_*` variables `get` finds.
    pub(crate) fn read(&mut self, get: &dyn Fn(&str) -> Option<String>) -> Result<()> {
        let num = |k: &str| -> Result<Option<u64>> { get(k).map(|v| parse(k, &v)).transpose() };
        let text = |k: &str| {
            get(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        if let Some(v) = text("BTL_RDMA_PROVIDER") {
            self.provider = Some(v);
        }
        if let Some(v) = text("BTL_RDMA_ADDR") {
            self.addr = Some(v);
        }
        if let Some(v) = num("BTL_RDMA_EAGER")? {
            self.eager = v as usize;
        }
        if let Some(v) = num("BTL_RDMA_CREDITS")? {
            self.credits = u32::try_from(v).unwrap_or(u32::MAX);
        }
        if let Some(v) = num("BTL_RDMA_PEER_TIMEOUT_MS")? {
            self.peer_timeout = Duration::from_millis(v.max(1));
        }
        if let Some(v) = get("BTL_RDMA_BUNDLE") {
            self.bundle = switch(&v).ok_or_else(|| {
                Error::Config(format!(
                    "BTL_RDMA_BUNDLE={v:?}: use 1 (gather small messages, the default) or 0 (a frame per message)"
                ))
            })?;
        }
        Ok(())
    }

    /// Check that the settings make sense.
    pub(crate) fn validate(&self) -> Result<()> {
        if !(MIN_EAGER..=MAX_EAGER).contains(&self.eager) {
            return Err(Error::Config(format!(
                "rdma eager size {} must be between {MIN_EAGER} and {MAX_EAGER} bytes (BTL_RDMA_EAGER)",
                self.eager
            )));
        }
        if !(2..=4096).contains(&self.credits) {
            return Err(Error::Config(format!(
                "rdma credits {} must be between 2 and 4096 (BTL_RDMA_CREDITS)",
                self.credits
            )));
        }
        if self.provider.as_deref() == Some("shm") {
            return Err(Error::Config(
                "BTL_RDMA_PROVIDER=shm: same-node peers use the sm transport; name a network provider (tcp;ofi_rxm, verbs;ofi_rxm, efa, ...)".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<RdmaConfig> {
        let mut c = RdmaConfig::default();
        c.read(&|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })?;
        c.validate()?;
        Ok(c)
    }

    #[test]
    fn variables_override_the_defaults_and_bad_ones_are_refused() {
        let c = with(&[
            ("BTL_RDMA_PROVIDER", "tcp;ofi_rxm"),
            ("BTL_RDMA_ADDR", "127.0.0.1"),
            ("BTL_RDMA_EAGER", "4096"),
            ("BTL_RDMA_CREDITS", "8"),
            ("BTL_RDMA_PEER_TIMEOUT_MS", "900"),
            ("BTL_RDMA_BUNDLE", "off"),
        ])
        .unwrap();
        assert_eq!(c.provider.as_deref(), Some("tcp;ofi_rxm"));
        assert_eq!(c.addr.as_deref(), Some("127.0.0.1"));
        assert_eq!((c.eager, c.credits), (4096, 8));
        assert_eq!(c.peer_timeout, Duration::from_millis(900));
        assert!(!c.bundle);
        assert_eq!(with(&[]).unwrap(), RdmaConfig::default());
        for bad in [
            ("BTL_RDMA_EAGER", "10"),
            ("BTL_RDMA_CREDITS", "1"),
            ("BTL_RDMA_PROVIDER", "shm"),
            ("BTL_RDMA_CREDITS", "lots"),
            ("BTL_RDMA_BUNDLE", "maybe"),
        ] {
            let e = with(&[bad]).unwrap_err().to_string();
            assert!(e.contains(bad.0), "{bad:?}: {e}");
        }
    }
}

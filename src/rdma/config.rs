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
    ///
    /// `None` (the default) chooses by provider: 64 KiB + 32 B over
    /// `tcp` ([`RdmaConfig::EAGER_TCP`]), where every byte crosses a socket anyway, so
    /// a rendezvous read saves no copy and only adds three trips (a 64 KiB
    /// message then takes half the time, and 32-128 KiB streams 1.4-1.7x
    /// as fast, than by rendezvous from 16 KiB frames); 16 KiB + 32 B
    /// elsewhere ([`RdmaConfig::EAGER_RDMA`]), where a read moves the data with no
    /// copy by the CPU. Either way a 16 KiB message goes in one frame.
    /// Receive buffers are this size, posted as the traffic needs them (at
    /// most a credit window and a few more per sender, and 4096 in all).
    ///
    /// Over `ofi_rxm` this is also rxm's own eager limit and buffer size
    /// (`FI_OFI_RXM_EAGER_LIMIT`, `FI_OFI_RXM_BUFFER_SIZE`, set to it
    /// unless the user set them, before libfabric starts, so before the
    /// provider is known: chosen by default for the provider named in
    /// `provider`, else for `tcp` on a host with no RDMA device in
    /// `/sys/class/infiniband` or `/sys/class/cxi`, else for a hardware
    /// provider): a frame above rxm's limit would take its segmented or
    /// rendezvous path, the slowest of all, so where rxm's limit is lower,
    /// frames are kept within it. rxm's shared receive queue then holds
    /// as many of its buffers as fit in the memory of its defaults (4096
    /// of 16 KiB: with 64 KiB frames, 1023; `FI_OFI_RXM_MSG_RX_SIZE`,
    /// unless the user set it or turned the shared queue off). All ranks
    /// must agree on it. Env: `BTL_RDMA_EAGER` (bytes).
    pub eager: Option<usize>,
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
            eager: None,
            credits: 128,
            peer_timeout: Duration::from_secs(5),
            bundle: true,
        }
    }
}

impl RdmaConfig {
    /// The default eager frame over `tcp` (see [`RdmaConfig::eager`]): a
    /// 64 KiB message and the transport's header.
    pub const EAGER_TCP: usize = (64 << 10) + crate::rdma::wire::HEADER;
    /// The default eager frame over other providers (see
    /// [`RdmaConfig::eager`]): a 16 KiB message and the transport's header.
    pub const EAGER_RDMA: usize = (16 << 10) + crate::rdma::wire::HEADER;
}

/// The default eager frame for provider `name` (`tcp;ofi_rxm`,
/// `verbs;ofi_rxm`, ...).
#[cfg_attr(not(feature = "rdma"), allow(dead_code))] // used by the transport
pub(crate) fn eager_for(name: &str) -> usize {
    if name.split(';').next() == Some("tcp") {
        RdmaConfig::EAGER_TCP
    } else {
        RdmaConfig::EAGER_RDMA
    }
}

/// Whether the kernel lists an RDMA device (InfiniBand, RoCE, iWARP,
/// EFA and Omni-Path under `/sys/class/infiniband`, Slingshot under
/// `/sys/class/cxi`), for which a hardware provider would be chosen.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))] // used by the transport
fn rdma_hardware() -> bool {
    ["/sys/class/infiniband", "/sys/class/cxi"]
        .iter()
        .any(|d| std::fs::read_dir(d).is_ok_and(|mut rd| rd.next().is_some()))
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
            self.eager = Some(v as usize);
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

    /// The eager frame libfabric starts with (rxm's sizes are read then,
    /// before a provider is chosen; see [`RdmaConfig::eager`]): the one
    /// set, else the default for the provider named, else for `tcp` on a
    /// host with no RDMA device, else for a hardware provider.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))] // used by the transport
    pub(crate) fn start_frame(&self) -> usize {
        match (self.eager, &self.provider) {
            (Some(e), _) => e,
            (None, Some(p)) => eager_for(p),
            (None, None) if rdma_hardware() => RdmaConfig::EAGER_RDMA,
            (None, None) => RdmaConfig::EAGER_TCP,
        }
    }

    /// Check that the settings make sense.
    pub(crate) fn validate(&self) -> Result<()> {
        if let Some(eager) = self.eager.filter(|e| !(MIN_EAGER..=MAX_EAGER).contains(e)) {
            return Err(Error::Config(format!(
                "rdma eager size {eager} must be between {MIN_EAGER} and {MAX_EAGER} bytes (BTL_RDMA_EAGER)"
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
        assert_eq!((c.eager, c.credits), (Some(4096), 8));
        assert_eq!(c.peer_timeout, Duration::from_millis(900));
        assert!(!c.bundle);
        assert_eq!(with(&[]).unwrap(), RdmaConfig::default());
        // The default frame follows the provider; a set one wins.
        assert_eq!(eager_for("tcp;ofi_rxm"), RdmaConfig::EAGER_TCP);
        assert_eq!(eager_for("tcp"), RdmaConfig::EAGER_TCP);
        assert_eq!(eager_for("verbs;ofi_rxm"), RdmaConfig::EAGER_RDMA);
        assert_eq!(eager_for("efa"), RdmaConfig::EAGER_RDMA);
        assert_eq!(c.start_frame(), 4096);
        let named = with(&[("BTL_RDMA_PROVIDER", "verbs;ofi_rxm")]).unwrap();
        assert_eq!(named.start_frame(), RdmaConfig::EAGER_RDMA);
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

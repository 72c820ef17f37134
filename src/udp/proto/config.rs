//! Tunables of the UDP reliability protocol.

use std::time::Duration;

use super::header::DATA_HEADER_LEN;
use super::seal::Guard;

/// Largest UDP payload over IPv4; also the cap over IPv6 (which would allow
/// 65527), so one limit holds for both families.
const MAX_UDP_PAYLOAD: usize = 65_507;
/// Largest window accepted, in segments; keeps windows tiny against the
/// 2^63 range of the sequence-number comparison and bounds memory.
pub(crate) const MAX_WINDOW: u32 = 1 << 20;

/// Protocol parameters. Both sides of a connection should use the same
/// values; a receive window smaller than the peer's send window works but
/// wastes bandwidth on out-of-window drops and retransmissions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Largest datagram (UDP payload) sent, headers included. Default 1472:
    /// a 1500-byte Ethernet MTU minus 20 bytes of IPv4 and 8 of UDP header,
    /// so datagrams never fragment at the IP layer on a standard link.
    pub max_datagram: usize,
    /// Most unacknowledged DATA segments in flight. Default 256: about 350 KB
    /// with default datagrams, several times a LAN's bandwidth-delay product
    /// (10 Gb/s × 100 µs ≈ 125 KB), so the window does not cap throughput.
    pub send_window: u32,
    /// Out-of-order segments accepted past the next expected one, counting
    /// it. Default 256, equal to the default send window so a full window of
    /// in-flight data can be buffered while a hole is repaired.
    pub recv_window: u32,
    /// Bytes of messages queued or unacknowledged before
    /// [`Connection::send`](super::Connection::send) refuses with
    /// `WouldBlock`. Default 1 MiB: about three send windows, so the window
    /// never starves while the caller refills, and a thousand peers cost at
    /// most about 1 GiB.
    pub send_budget: usize,
    /// How long an ACK may wait for data to ride on. Default 1 ms: the
    /// granularity of tokio's timer, and well below `rto_min` so a delayed
    /// ACK never causes a spurious retransmission.
    pub ack_delay: Duration,
    /// How long an ACK the sender asked for (`ACK_NOW`: the tail of what it
    /// could send) waits for a reply to ride on. Default 50 µs: a
    /// request/response pair then costs one datagram each way instead of
    /// two, while the sender's window and `flush` wait only a few
    /// microseconds more. Retransmissions are still acknowledged at once.
    /// Never more than `ack_delay`.
    pub reply_ack_delay: Duration,
    /// Send an ACK at once after this many in-order segments. Default 8:
    /// 1/32 of the window, so the sender's window slides smoothly while ACK
    /// traffic stays an eighth of data traffic.
    pub ack_every: u32,
    /// Retransmission timeout before any round trip has been measured.
    /// Default 20 ms: generous for a LAN plus scheduler and timer slop.
    pub rto_initial: Duration,
    /// Floor of the measured retransmission timeout. Default 5 ms: a few
    /// times `ack_delay` plus timer granularity, so delayed ACKs and a busy
    /// peer do not look like loss.
    pub rto_min: Duration,
    /// Cap of the exponentially backed-off timeout. Default 1 s: keeps
    /// probing several times within `peer_timeout`.
    pub rto_max: Duration,
    /// With data unacknowledged, this long without ACK progress declares the
    /// peer lost. Default 5 s: "a few seconds" per the design; long enough to
    /// ride out a stalled peer, short enough that failures surface.
    pub peer_timeout: Duration,
    /// Duplicate ACKs (ACK-only, `GAP` flag, no progress) that trigger a fast
    /// retransmit. Default 3, as TCP: one or two can come from reordering.
    pub dup_ack_threshold: u32,
    /// Messages up to this many bytes go on the priority channel (first
    /// transmission only; retransmissions use the data channel as in the
    /// seed). Default 256: tiny control messages skip the bulk queue, while
    /// anything near a datagram stays in order with the rest.
    pub priority_threshold: usize,
    /// Largest message accepted, on send and on receive. Default 1 GiB. The
    /// receiver never reserves more than this for one message.
    pub max_message: u64,
    /// Selective acknowledgement. Default on: ACK-only packets list the
    /// runs held past the hole, and the sender resends every hole they
    /// reveal at once, instead of one hole per round trip. Off, the
    /// receiver sends no SACK blocks and the sender ignores any it gets,
    /// leaving duplicate-ACK fast retransmit and partial-ACK recovery.
    pub sack: bool,
    /// What closes every datagram: a CRC32C ([`Guard::Crc`], the default
    /// here) or a keyed MAC ([`Guard::Mac`], which needs keys: see
    /// [`Connection::with_seal`](super::Connection::with_seal)). Both sides
    /// must use the same.
    pub guard: Guard,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_datagram: 1472,
            send_window: 256,
            recv_window: 256,
            send_budget: 1 << 20,
            ack_delay: Duration::from_millis(1),
            reply_ack_delay: Duration::from_micros(50),
            ack_every: 8,
            rto_initial: Duration::from_millis(20),
            rto_min: Duration::from_millis(5),
            rto_max: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(5),
            dup_ack_threshold: 3,
            priority_threshold: 256,
            max_message: 1 << 30,
            sack: true,
            guard: Guard::Crc,
        }
    }
}

/// A [`Config`] value out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid UDP protocol configuration: {0}; fix the setting (see udp::proto::Config docs)")]
pub struct ConfigError(pub &'static str);

impl Config {
    /// Payload bytes carried by one DATA datagram.
    pub fn chunk_payload(&self) -> usize {
        self.max_datagram.saturating_sub(self.data_overhead())
    }

    /// Bytes a DATA datagram spends on headers and trailer.
    pub fn data_overhead(&self) -> usize {
        DATA_HEADER_LEN + self.guard.trailer_len()
    }

    /// Checks that every value is usable.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |what| Err(ConfigError(what));
        if self.max_datagram <= self.data_overhead() || self.max_datagram > MAX_UDP_PAYLOAD {
            return err(
                "max_datagram must be above the header and trailer (72 bytes, 92 with a MAC) and at most 65507",
            );
        }
        if !(1..=MAX_WINDOW).contains(&self.send_window) {
            return err("send_window must be in 1..=2^20 segments");
        }
        if !(1..=MAX_WINDOW).contains(&self.recv_window) {
            return err("recv_window must be in 1..=2^20 segments");
        }
        if self.send_budget == 0 {
            return err("send_budget must be positive");
        }
        if self.ack_every == 0 {
            return err("ack_every must be at least 1");
        }
        if self.rto_min.is_zero()
            || self.rto_min > self.rto_initial
            || self.rto_initial > self.rto_max
        {
            return err("need 0 < rto_min <= rto_initial <= rto_max");
        }
        if self.peer_timeout.is_zero() {
            return err("peer_timeout must be positive");
        }
        if self.dup_ack_threshold == 0 {
            return err("dup_ack_threshold must be at least 1");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_fits_ethernet() {
        let c = Config::default();
        c.validate().unwrap();
        assert_eq!(c.chunk_payload() + c.data_overhead(), 1472);
        let mac = Config {
            guard: Guard::Mac,
            ..Config::default()
        };
        assert_eq!(mac.chunk_payload() + 20, c.chunk_payload());
        let bad = Config {
            rto_min: Duration::from_secs(2),
            ..Config::default()
        };
        assert!(bad.validate().is_err());
        let bad = Config {
            max_datagram: 50,
            ..Config::default()
        };
        assert!(bad.validate().is_err());
    }
}

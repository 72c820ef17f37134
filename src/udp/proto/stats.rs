//! Per-connection counters and window extents.

use std::fmt;
use std::time::Duration;

/// Counters of one connection since it was created, plus a snapshot of its
/// windows taken when [`Connection::stats`](super::Connection::stats) was
/// called. Counters only grow.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Datagrams handed to the driver, of every kind.
    pub datagrams_sent: u64,
    /// Of those, datagrams marked for the priority channel.
    pub priority_sent: u64,
    /// DATA segments sent for the first time.
    pub data_sent: u64,
    /// DATA segments sent again (fast plus timeout-driven resends).
    pub resends: u64,
    /// Resends triggered by SACK blocks, duplicate ACKs or a partial ACK
    /// during recovery.
    pub fast_retransmits: u64,
    /// Retransmission-timer expiries (each resends the oldest segment, and
    /// with SACK the holes below the highest SACKed segment that waited a
    /// whole timeout).
    pub timeout_retransmits: u64,
    /// ACK-only datagrams sent.
    pub acks_sent: u64,
    /// Messages accepted by `send`.
    pub messages_sent: u64,
    /// `send` calls refused with `WouldBlock`.
    pub would_block: u64,
    /// Messages whose last byte the peer acknowledged.
    pub messages_acked: u64,

    /// Datagrams handed to `handle_datagram`.
    pub datagrams_received: u64,
    /// New DATA segments accepted (in order or buffered).
    pub data_received: u64,
    /// Of those, segments that arrived ahead of a hole and were buffered.
    pub out_of_order: u64,
    /// ACK-only datagrams received.
    pub acks_received: u64,
    /// Duplicate ACKs counted toward fast retransmit.
    pub dup_acks: u64,
    /// ACKs older than the current send base (reordered), ignored.
    pub old_acks: u64,
    /// ACKs for sequence numbers never sent, ignored.
    pub invalid_acks: u64,
    /// DATA segments already received, dropped.
    pub duplicates_dropped: u64,
    /// DATA segments beyond the receive window, dropped.
    pub out_of_window_dropped: u64,
    /// Datagrams whose trailer failed (the CRC32C, or the MAC under
    /// [`Guard::Mac`](super::Guard::Mac): corrupted or forged), dropped.
    pub checksum_errors: u64,
    /// Authentic datagrams played back (under [`Guard::Mac`](super::Guard::Mac):
    /// a MAC counter already taken), dropped.
    pub replays_dropped: u64,
    /// Datagrams failing any other decode check, dropped.
    pub decode_errors: u64,
    /// Well-formed datagrams for another job, rank pair or direction, dropped.
    pub misdirected: u64,
    /// Well-formed segments that broke message framing (wrong message id,
    /// offset or length, or a message over `max_message`), dropped.
    pub protocol_errors: u64,
    /// Messages delivered as `Event::Message`.
    pub messages_delivered: u64,
    /// Bytes in those messages.
    pub bytes_delivered: u64,

    /// Send window base: oldest unacknowledged sequence number.
    pub send_base: u64,
    /// Next sequence number to be sent.
    pub send_next: u64,
    /// Segments sent and not yet acknowledged (`send_next - send_base`).
    pub send_unacked: u64,
    /// Bytes charged against the send budget (queued or unacknowledged).
    pub send_buffered_bytes: u64,
    /// Receive window base: next sequence number expected in order.
    pub recv_base: u64,
    /// Out-of-order segments held in the receive window.
    pub recv_buffered: u64,
    /// Smoothed round-trip time (zero until measured).
    pub srtt: Duration,
    /// Current retransmission timeout, backoff included.
    pub rto: Duration,
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TX {} (prio {}) data/resend(fast+rto)/ack {}/{}({}+{})/{} msgs {} acked {} blocked {} | \
             RX {} data {} ooo {} ack {} dupack/old/bad {}/{}/{} drop dup/oow/crc/replay/bad/misdir/proto \
             {}/{}/{}/{}/{}/{}/{} msgs {} bytes {} | \
             win S {}..{} ({} unacked, {} B) R {} ({} buffered) srtt {:?} rto {:?}",
            self.datagrams_sent,
            self.priority_sent,
            self.data_sent,
            self.resends,
            self.fast_retransmits,
            self.timeout_retransmits,
            self.acks_sent,
            self.messages_sent,
            self.messages_acked,
            self.would_block,
            self.datagrams_received,
            self.data_received,
            self.out_of_order,
            self.acks_received,
            self.dup_acks,
            self.old_acks,
            self.invalid_acks,
            self.duplicates_dropped,
            self.out_of_window_dropped,
            self.checksum_errors,
            self.replays_dropped,
            self.decode_errors,
            self.misdirected,
            self.protocol_errors,
            self.messages_delivered,
            self.bytes_delivered,
            self.send_base,
            self.send_next,
            self.send_unacked,
            self.send_buffered_bytes,
            self.recv_base,
            self.recv_buffered,
            self.srtt,
            self.rto,
        )
    }
}

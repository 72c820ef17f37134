//! Send side: message queue, lazy chunking, in-flight segments, ACK
//! processing, retransmission, RTT estimate and the two send-side timers
//! (retransmission and peer loss).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::config::Config;
use super::conn::{Event, MsgId, SendError};
use super::header::{Chunk, Flags, Sack};
use super::seq::Seq;
use super::stats::Stats;

/// Budget charged per message on top of its length, so that a flood of
/// empty messages is bounded too.
pub(super) const MSG_OVERHEAD: usize = 64;

/// Largest backoff exponent; far beyond any `rto_max / rto_min` ratio.
const MAX_BACKOFF: u32 = 20;

/// Most holes one ACK's SACK blocks may queue for resending. ACK-only
/// packets come one per out-of-order arrival, so this still repairs a whole
/// window of holes per round trip, while one ACK never sets off a burst.
const SACK_RESENDS_PER_ACK: usize = 4;

/// A message not yet fully cut into segments.
struct Queued {
    id: u64,
    data: Bytes,
    /// Offset of the first byte not yet in a segment.
    next: usize,
}

/// A segment sent and not yet acknowledged.
struct Segment {
    chunk: Chunk,
    /// A zero-copy slice of the caller's message.
    payload: Bytes,
    /// Time of the latest transmission.
    sent_at: Instant,
    transmissions: u32,
    resend_queued: bool,
    /// The peer reported holding it (SACK); it is never resent, unless the
    /// peer's cumulative ACK stops at it when the timer fires.
    sacked: bool,
    /// Serial number of its latest transmission: once the peer SACKs a
    /// segment transmitted later on the data channel, this transmission
    /// was overtaken and is presumed lost.
    serial: u64,
    /// First sent on the priority channel.
    priority: bool,
}

impl Segment {
    /// Whether its latest transmission went on the data channel, which
    /// keeps order; priority packets may overtake it, so the peer holding
    /// one says nothing about the data-channel packets sent before it.
    fn on_data_channel(&self) -> bool {
        !self.priority || self.transmissions > 1
    }

    fn is_last(&self) -> bool {
        self.chunk.offset + self.payload.len() as u64 == self.chunk.total_len
    }
}

/// A DATA segment ready to be encoded.
pub(super) struct Outgoing {
    pub seq: u64,
    pub chunk: Chunk,
    pub payload: Bytes,
    pub flags: Flags,
    pub priority: bool,
}

/// The ACK information of one received packet.
pub(super) struct AckInfo {
    /// The cumulative ACK.
    pub ack: u64,
    /// The packet had the `GAP` flag: the peer holds data past a hole at
    /// `ack`.
    pub gap: bool,
    /// The packet was ACK-only (only those count as duplicate ACKs).
    pub ack_only: bool,
    /// Its SACK blocks (none on DATA packets).
    pub sack: Sack,
}

/// RFC 6298 round-trip estimator.
#[derive(Default)]
struct Rtt {
    srtt: Duration,
    rttvar: Duration,
    measured: bool,
}

impl Rtt {
    fn update(&mut self, sample: Duration) {
        if self.measured {
            let delta = if self.srtt > sample {
                self.srtt - sample
            } else {
                sample - self.srtt
            };
            self.rttvar = self.rttvar.saturating_mul(3).saturating_add(delta) / 4;
            self.srtt = self.srtt.saturating_mul(7).saturating_add(sample) / 8;
        } else {
            self.srtt = sample;
            self.rttvar = sample / 2;
            self.measured = true;
        }
    }
}

pub(super) struct SendSide {
    window: usize,
    chunk: usize,
    budget: usize,
    priority_threshold: usize,
    max_message: u64,
    rto_initial: Duration,
    rto_min: Duration,
    rto_max: Duration,
    peer_timeout: Duration,
    dup_threshold: u32,
    sack: bool,

    next_msg: u64,
    queue: VecDeque<Queued>,
    /// `inflight[i]` has sequence number `una + i`.
    inflight: VecDeque<Segment>,
    una: Seq,
    /// Bytes charged against the budget by messages not yet fully acked.
    charged: usize,
    /// Sequence numbers waiting to be resent, oldest first.
    resend: VecDeque<Seq>,
    rtt: Rtt,
    backoff: u32,
    rto_deadline: Option<Instant>,
    dup_acks: u32,
    /// While repairing loss: the send-next value when repair began. ACKs
    /// short of it are partial and trigger the next resend.
    recovery: Option<Seq>,
    /// Last ACK progress, or when data went out with nothing outstanding.
    last_progress: Instant,
    /// One past the highest sequence number the peer has SACKed; `una` when
    /// it has SACKed nothing above the cumulative ACK.
    sack_high: Seq,
    /// Serial number of the latest DATA transmission.
    serial: u64,
    /// Highest serial of a data-channel transmission the peer SACKed.
    sacked_serial: u64,
}

impl SendSide {
    /// The peer says it is alive but holding our data back: restart the
    /// no-progress (stall) timer.
    pub fn peer_busy(&mut self, now: Instant) {
        self.last_progress = now;
    }

    /// The largest message `send` accepts.
    pub fn max_message(&self) -> u64 {
        self.max_message
    }

    pub fn new(cfg: &Config, isn: u64, now: Instant) -> Self {
        SendSide {
            window: cfg.send_window as usize,
            chunk: cfg.chunk_payload(),
            budget: cfg.send_budget,
            priority_threshold: cfg.priority_threshold,
            max_message: cfg.max_message,
            rto_initial: cfg.rto_initial,
            rto_min: cfg.rto_min,
            rto_max: cfg.rto_max,
            peer_timeout: cfg.peer_timeout,
            dup_threshold: cfg.dup_ack_threshold,
            sack: cfg.sack,
            next_msg: 0,
            queue: VecDeque::new(),
            inflight: VecDeque::new(),
            una: Seq(isn),
            charged: 0,
            resend: VecDeque::new(),
            rtt: Rtt::default(),
            backoff: 0,
            rto_deadline: None,
            dup_acks: 0,
            recovery: None,
            last_progress: now,
            sack_high: Seq(isn),
            serial: 0,
            sacked_serial: 0,
        }
    }

    pub fn nxt(&self) -> Seq {
        self.una.wrapping_add(self.inflight.len() as u64)
    }

    fn fits(&self, len: usize) -> bool {
        self.charged == 0 || self.charged.saturating_add(len + MSG_OVERHEAD) <= self.budget
    }

    pub fn can_send(&self, len: usize) -> bool {
        len as u64 <= self.max_message && self.fits(len)
    }

    pub fn queue(&mut self, msg: Bytes, stats: &mut Stats) -> Result<MsgId, SendError> {
        let len = msg.len();
        if len as u64 > self.max_message {
            return Err(SendError::TooLarge {
                len: len as u64,
                max: self.max_message,
            });
        }
        if !self.fits(len) {
            stats.would_block += 1;
            return Err(SendError::WouldBlock(msg));
        }
        let id = self.next_msg;
        self.next_msg = self.next_msg.wrapping_add(1);
        self.charged = self.charged.saturating_add(len + MSG_OVERHEAD);
        self.queue.push_back(Queued {
            id,
            data: msg,
            next: 0,
        });
        stats.messages_sent += 1;
        Ok(MsgId(id))
    }

    /// The next DATA segment to send: a queued resend first, else new data
    /// if the window is open.
    pub fn next_segment(&mut self, now: Instant, stats: &mut Stats) -> Option<Outgoing> {
        self.next_resend(now, stats)
            .or_else(|| self.next_new(now, stats))
    }

    fn next_resend(&mut self, now: Instant, stats: &mut Stats) -> Option<Outgoing> {
        while let Some(seq) = self.resend.pop_front() {
            let Ok(idx) = usize::try_from(seq.diff(self.una)) else {
                continue; // acknowledged meanwhile
            };
            let Some(seg) = self.inflight.get_mut(idx) else {
                continue;
            };
            seg.resend_queued = false;
            if seg.sacked {
                continue; // the peer has it after all
            }
            seg.transmissions += 1;
            seg.sent_at = now;
            self.serial += 1;
            seg.serial = self.serial;
            stats.resends += 1;
            return Some(Outgoing {
                seq: seq.0,
                chunk: seg.chunk,
                payload: seg.payload.clone(),
                flags: Flags::RETRANSMIT.with(Flags::ACK_NOW),
                priority: false,
            });
        }
        None
    }

    fn next_new(&mut self, now: Instant, stats: &mut Stats) -> Option<Outgoing> {
        if self.inflight.len() >= self.window {
            return None;
        }
        let q = self.queue.front_mut()?;
        let len = q.data.len();
        let n = self.chunk.min(len - q.next);
        let payload = q.data.slice(q.next..q.next + n);
        let chunk = Chunk {
            msg_id: q.id,
            offset: q.next as u64,
            total_len: len as u64,
        };
        q.next += n;
        if q.next >= len {
            self.queue.pop_front();
        }
        let seq = self.nxt();
        if self.inflight.is_empty() {
            // Nothing was outstanding: both timers start now.
            self.last_progress = now;
            self.rto_deadline = now.checked_add(self.rto());
        }
        let priority = len <= self.priority_threshold;
        self.serial += 1;
        self.inflight.push_back(Segment {
            chunk,
            payload: payload.clone(),
            sent_at: now,
            transmissions: 1,
            resend_queued: false,
            sacked: false,
            serial: self.serial,
            priority,
        });
        stats.data_sent += 1;
        // Ask for a prompt ACK when this is the tail of what we can send.
        let tail = self.queue.is_empty() || self.inflight.len() >= self.window;
        let mut flags = if tail { Flags::ACK_NOW } else { Flags::NONE };
        if priority {
            flags = flags.with(Flags::PRIORITY);
        }
        Some(Outgoing {
            seq: seq.0,
            chunk,
            payload,
            flags,
            priority,
        })
    }

    /// Queues the oldest unacknowledged segment for resending; false if it
    /// is already queued or nothing is outstanding.
    fn resend_front(&mut self) -> bool {
        match self.inflight.front_mut() {
            Some(seg) if !seg.resend_queued => {
                seg.resend_queued = true;
                self.resend.push_back(self.una);
                true
            }
            _ => false,
        }
    }

    /// Processes the cumulative ACK of a packet from the peer. `gap`: the
    /// packet had the `GAP` flag (the peer holds data past a hole at `ack`);
    /// `ack_only`: it was an ACK-only packet.
    pub fn on_ack(
        &mut self,
        now: Instant,
        ack: AckInfo,
        events: &mut VecDeque<Event>,
        stats: &mut Stats,
    ) {
        let AckInfo {
            ack,
            gap,
            ack_only,
            sack,
        } = ack;
        // With SACK, the blocks say which holes to resend; duplicate-ACK
        // counting and partial-ACK recovery only run without them.
        let use_sack = self.sack && !sack.is_empty();
        let n = Seq(ack).diff(self.una);
        if n == 0 {
            if use_sack {
                if gap && ack_only && !self.inflight.is_empty() {
                    stats.dup_acks += 1;
                }
                self.on_sack(&sack, stats);
                return;
            }
            if gap && ack_only && !self.inflight.is_empty() {
                self.dup_acks += 1;
                stats.dup_acks += 1;
                if self.dup_acks >= self.dup_threshold && self.recovery.is_none() {
                    if self.resend_front() {
                        stats.fast_retransmits += 1;
                    }
                    self.recovery = Some(self.nxt());
                }
            }
            return;
        }
        let Ok(n) = usize::try_from(n) else {
            stats.old_acks += 1;
            return;
        };
        if n > self.inflight.len() {
            stats.invalid_acks += 1;
            return;
        }
        // Karn's rule: only an ACK for segments all sent once gives a clean
        // sample, taken from the newest of them. A range with a resent
        // segment was held up behind a hole: no sample.
        let mut clean = true;
        let mut newest = None;
        for seg in self.inflight.drain(..n) {
            if seg.is_last() {
                events.push_back(Event::Acked(MsgId(seg.chunk.msg_id)));
                stats.messages_acked += 1;
                let charge = (seg.chunk.total_len as usize).saturating_add(MSG_OVERHEAD);
                self.charged = self.charged.saturating_sub(charge);
            }
            clean &= seg.transmissions == 1;
            newest = Some(seg.sent_at);
        }
        self.una = self.una.wrapping_add(n as u64);
        if self.sack_high.is_before(self.una) {
            self.sack_high = self.una;
        }
        if let (true, Some(sent_at)) = (clean, newest) {
            self.rtt.update(now.saturating_duration_since(sent_at));
        }
        self.backoff = 0;
        self.dup_acks = 0;
        self.last_progress = now;
        if let Some(point) = self.recovery {
            if self.una.is_before(point) {
                // Partial ACK pointing at a hole: resend the hole now
                // rather than wait for duplicate ACKs or the timer.
                if gap && !use_sack && self.resend_front() {
                    stats.fast_retransmits += 1;
                }
            } else {
                self.recovery = None;
            }
        }
        self.rto_deadline = if self.inflight.is_empty() {
            None
        } else {
            now.checked_add(self.rto())
        };
        if use_sack {
            self.on_sack(&sack, stats);
        }
    }

    /// Marks the segments the peer SACKed, then queues up to
    /// [`SACK_RESENDS_PER_ACK`] holes, lowest first. The peer lists its
    /// lowest runs in order, so an unSACKed segment below the end of this
    /// ACK's last block is missing. One sent once is presumed lost when at
    /// least `dup_ack_threshold` segments above it are SACKed (fewer may be
    /// reordering); one already resent, when a segment transmitted after its
    /// latest transmission is SACKed, resent or new, anywhere in the window
    /// (so a lost resend is resent in the next round trip, without waiting
    /// for the timer). Only segments whose latest
    /// transmission went on the data channel count as evidence: priority
    /// packets overtake the data channel by design. Blocks outside the
    /// window are ignored.
    fn on_sack(&mut self, sack: &Sack, stats: &mut Stats) {
        let len = self.inflight.len() as u64;
        // One past the highest segment this ACK SACKs (an index).
        let mut top = 0u64;
        for b in sack.blocks() {
            let Ok(first) = u64::try_from(Seq(b.start).diff(self.una)) else {
                continue;
            };
            // Index 0 is the hole the cumulative ACK points at.
            let first = first.max(1);
            let end = Seq(b.start).diff(self.una).saturating_add(i64::from(b.len));
            let end = u64::try_from(end).unwrap_or(0).min(len);
            for i in first..end {
                // In range: i < len, the length of `inflight`.
                let seg = &mut self.inflight[i as usize];
                seg.sacked = true;
                top = top.max(i + 1);
                if seg.on_data_channel() {
                    self.sacked_serial = self.sacked_serial.max(seg.serial);
                }
            }
        }
        let after = self.una.wrapping_add(top);
        if self.sack_high.is_before(after) {
            self.sack_high = after;
        }
        let top = top as usize;
        let mut above = self
            .inflight
            .iter()
            .take(top)
            .filter(|s| s.sacked && s.on_data_channel())
            .count();
        let threshold = self.dup_threshold as usize;
        let mut queued = 0;
        for i in 0..top {
            if queued >= SACK_RESENDS_PER_ACK || above == 0 {
                break;
            }
            let seg = &mut self.inflight[i];
            if seg.sacked {
                if seg.on_data_channel() {
                    above -= 1;
                }
                continue;
            }
            let lost = if seg.transmissions == 1 {
                above >= threshold
            } else {
                seg.serial < self.sacked_serial
            };
            if lost && !seg.resend_queued {
                seg.resend_queued = true;
                self.resend.push_back(self.una.wrapping_add(i as u64));
                stats.fast_retransmits += 1;
                queued += 1;
            }
        }
    }

    /// Fires due timers. Returns true when the peer is to be declared lost.
    pub fn on_timeout(&mut self, now: Instant, stats: &mut Stats) -> bool {
        if self.inflight.is_empty() {
            return false;
        }
        if self
            .last_progress
            .checked_add(self.peer_timeout)
            .is_some_and(|t| t <= now)
        {
            return true;
        }
        if self.rto_deadline.is_some_and(|t| t <= now) {
            stats.timeout_retransmits += 1;
            if let Some(front) = self.inflight.front_mut() {
                // The cumulative ACK still stops here: whatever a SACK said,
                // the peer does not hold it now.
                front.sacked = false;
            }
            self.resend_front();
            if self.sack {
                // Holes below the highest SACKed segment that have waited a
                // whole timeout since their latest transmission are resent
                // too: at most one window per timeout, which backs off.
                let rto = self.rto();
                let high = usize::try_from(self.sack_high.diff(self.una)).unwrap_or(0);
                for i in 1..high.min(self.inflight.len()) {
                    let seg = &mut self.inflight[i];
                    let waited = now.saturating_duration_since(seg.sent_at) >= rto;
                    if !seg.sacked && !seg.resend_queued && waited {
                        seg.resend_queued = true;
                        self.resend.push_back(self.una.wrapping_add(i as u64));
                    }
                }
            }
            self.backoff = (self.backoff + 1).min(MAX_BACKOFF);
            self.dup_acks = 0;
            self.recovery = Some(self.nxt());
            self.rto_deadline = now.checked_add(self.rto());
        }
        false
    }

    /// Earliest send-side deadline: retransmission or peer loss.
    pub fn deadline(&self) -> Option<Instant> {
        if self.inflight.is_empty() {
            return None;
        }
        let loss = self.last_progress.checked_add(self.peer_timeout);
        match (self.rto_deadline, loss) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Current retransmission timeout, backoff included.
    pub fn rto(&self) -> Duration {
        let base = if self.rtt.measured {
            (self
                .rtt
                .srtt
                .saturating_add(self.rtt.rttvar.saturating_mul(4)))
            .clamp(self.rto_min, self.rto_max)
        } else {
            self.rto_initial
        };
        base.saturating_mul(1 << self.backoff).min(self.rto_max)
    }

    pub fn is_empty(&self) -> bool {
        self.inflight.is_empty() && self.queue.is_empty()
    }

    /// Segments sent and not yet acknowledged, plus messages not yet cut
    /// into segments.
    pub fn in_flight(&self) -> usize {
        self.inflight.len() + self.queue.len()
    }

    /// Payload bytes of one segment.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Whether [`next_segment`](Self::next_segment) would return a segment
    /// now: a resend is queued, or new data waits and the window is open.
    pub fn has_segment(&self) -> bool {
        !self.resend.is_empty() || (!self.queue.is_empty() && self.inflight.len() < self.window)
    }

    /// Ids of messages not fully acknowledged, in send order.
    pub fn unacked_messages(&self) -> Vec<MsgId> {
        let ids = self.inflight.iter().map(|s| s.chunk.msg_id);
        let ids = ids.chain(self.queue.iter().map(|q| q.id));
        let mut out: Vec<MsgId> = Vec::new();
        for id in ids {
            if out.last() != Some(&MsgId(id)) {
                out.push(MsgId(id));
            }
        }
        out
    }

    pub fn fill_stats(&self, stats: &mut Stats) {
        stats.send_base = self.una.0;
        stats.send_next = self.nxt().0;
        stats.send_unacked = self.inflight.len() as u64;
        stats.send_buffered_bytes = self.charged as u64;
        stats.srtt = self.rtt.srtt;
        stats.rto = self.rto();
    }
}

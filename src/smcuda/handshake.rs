//! The per-peer handshake that decides whether two ranks exchange GPU
//! memory through CUDA IPC, and how: a state machine with no I/O, so
//! every path is tested alone, and the wire form of its messages.
//!
//! It is the seed's (`btl_smcuda`'s IPC_REQ/IPC_ACK), made total:
//! * lazy: a rank starts it on its first GPU operation towards a peer
//!   ([`Handshake::start`]); operations wait for it to settle, and none
//!   is staged only because it had not yet (the seed sent those through
//!   the host);
//! * always answered: a request gets `Ack` (with the IPC kind both
//!   support), `NotReady` (the answering side's GPU layer is not up yet),
//!   `Refuse` with the reason, or `Crossed`;
//! * crossing requests (both ranks sent one) are broken by rank: the
//!   higher rank answers the lower's request as if it had sent none, and
//!   the lower answers the higher's with `Crossed` and waits for its own
//!   answer;
//! * `NotReady` sends the asker back to the start; after
//!   [`MAX_TRIES`] of them it settles on the staged path;
//! * a settled rank answers a new request with the same outcome, so a peer
//!   that asks again (it retried) learns it too.
//!
//! The transport runs it over the core's control messages (`Kind::Control`
//! on the pair's message link): the first device operation towards a peer
//! sends the request and waits for the answer (operations posted
//! meanwhile wait with it), then every operation with that peer goes by
//! IPC or through the host alike; a `NotReady` is asked again on the
//! heartbeat, and a request unanswered within the answer time limit
//! settles on the host path.
//!
//! The decision ([`decide`]) prefers VMM handles (file descriptors over a
//! Unix socket: they cross PID namespaces and containers) and falls back
//! to legacy handles only inside one PID namespace; MIG instances and
//! devices without peer access are refused with the reason.

use crate::Rank;

/// Requests answered `NotReady` before a rank gives up on IPC with that
/// peer.
pub(crate) const MAX_TRIES: u32 = 5;

/// The wire version of these messages.
const VERSION: u8 = 1;
/// The first byte of every handshake message.
const MAGIC: u8 = 0xc7;
/// The longest refusal reason carried (longer ones are cut).
pub(crate) const MAX_REASON: usize = 200;

/// What a rank says about its GPU side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Caps {
    /// Its GPU layer is up (the driver opened, a device chosen).
    pub(crate) ready: bool,
    /// The UUID of the device it uses.
    pub(crate) device: [u8; 16],
    /// It can share memory as VMM file descriptors.
    pub(crate) vmm: bool,
    /// It can share memory as legacy IPC handles.
    pub(crate) legacy: bool,
    /// Its device is a MIG instance.
    pub(crate) mig: bool,
    /// Its PID namespace (the inode of `/proc/self/ns/pid`).
    pub(crate) pidns: u64,
}

/// How two ranks exchange GPU memory once the handshake accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// VMM allocations, their descriptors passed over a Unix socket.
    Vmm,
    /// Legacy CUDA IPC handles.
    Legacy,
}

/// A handshake message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Msg {
    /// "May we use IPC?", with the asker's side.
    Req(Caps),
    /// Yes, this way.
    Ack(Mode),
    /// Ask again later: the answering side is not ready.
    NotReady,
    /// No, and why: both use the host-staged path.
    Refuse(String),
    /// Both asked at once and the asker has the higher rank: the answer
    /// comes to the request the answering (lower) rank sent.
    Crossed,
}

/// Where the handshake with one peer stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum State {
    /// Nothing asked yet (or asked again after `NotReady`); `tries`
    /// requests were answered `NotReady` so far.
    Init {
        /// `NotReady` answers so far.
        tries: u32,
    },
    /// Our request is out.
    Sent {
        /// `NotReady` answers before this request.
        tries: u32,
    },
    /// IPC accepted.
    Ready(Mode),
    /// IPC refused (by either side, or never ready): the host-staged path,
    /// with the reason.
    Staged(String),
}

/// What [`decide`] says about a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Accept, this way.
    Accept(Mode),
    /// Not ready to answer yet.
    NotReady,
    /// Refuse, with the reason.
    Refuse(String),
}

/// Decide a request: `mine` and `theirs` are both sides' capabilities;
/// `reach(uuid)` says whether our device may access the device with that
/// UUID (the same device, or peer access between two).
pub(crate) fn decide(mine: &Caps, theirs: &Caps, reach: impl Fn(&[u8; 16]) -> bool) -> Verdict {
    if !mine.ready {
        return Verdict::NotReady;
    }
    if !theirs.ready {
        return Verdict::Refuse("the asking rank has no GPU ready".into());
    }
    if mine.mig || theirs.mig {
        return Verdict::Refuse("a MIG instance: CUDA IPC is not supported under MIG".into());
    }
    if !reach(&theirs.device) {
        return Verdict::Refuse(format!(
            "this rank's GPU cannot access the peer's GPU {} (no peer access, or not visible here)",
            crate::sys::os::hex(&theirs.device)
        ));
    }
    if mine.vmm && theirs.vmm {
        return Verdict::Accept(Mode::Vmm);
    }
    if mine.legacy && theirs.legacy {
        if mine.pidns == theirs.pidns {
            return Verdict::Accept(Mode::Legacy);
        }
        return Verdict::Refuse(
            "the ranks are in different PID namespaces and one has no VMM: legacy CUDA IPC cannot cross them"
                .into(),
        );
    }
    if !theirs.vmm && !theirs.legacy {
        return Verdict::Refuse(
            "the peer offers no CUDA IPC (BTL_SMCUDA_IPC=off there, or no support)".into(),
        );
    }
    Verdict::Refuse("the ranks share no kind of CUDA IPC handle".into())
}

/// The handshake with one peer.
#[derive(Debug, Clone)]
pub(crate) struct Handshake {
    me: Rank,
    peer: Rank,
    state: State,
}

impl Handshake {
    /// Not started, between `me` and `peer`.
    pub(crate) fn new(me: Rank, peer: Rank) -> Handshake {
        Handshake {
            me,
            peer,
            state: State::Init { tries: 0 },
        }
    }

    /// Where it stands.
    pub(crate) fn state(&self) -> &State {
        &self.state
    }

    /// The mode, once accepted.
    #[cfg(test)]
    pub(crate) fn mode(&self) -> Option<Mode> {
        match self.state {
            State::Ready(m) => Some(m),
            _ => None,
        }
    }

    /// Settle on the staged path with `why` (no answer came in time);
    /// a settled handshake stays as it is.
    pub(crate) fn give_up(&mut self, why: String) {
        if matches!(self.state, State::Init { .. } | State::Sent { .. }) {
            self.state = State::Staged(why);
        }
    }

    /// We want to use IPC with the peer: the request to send, if one is
    /// due (none while one is out, or once settled).
    pub(crate) fn start(&mut self, mine: &Caps) -> Option<Msg> {
        match self.state {
            State::Init { tries } => {
                self.state = State::Sent { tries };
                Some(Msg::Req(*mine))
            }
            _ => None,
        }
    }

    /// A message from the peer arrived: the answer to send, if any.
    /// Messages that make no sense in the current state are ignored
    /// (`None`) and leave it as it was.
    pub(crate) fn on_msg(
        &mut self,
        msg: Msg,
        mine: &Caps,
        reach: impl Fn(&[u8; 16]) -> bool,
    ) -> Option<Msg> {
        match (msg, self.state.clone()) {
            (Msg::Req(theirs), State::Init { tries }) => {
                Some(self.answer(tries, &theirs, mine, reach))
            }
            (Msg::Req(theirs), State::Sent { tries }) => {
                if self.me > self.peer {
                    Some(self.answer(tries, &theirs, mine, reach))
                } else {
                    Some(Msg::Crossed)
                }
            }
            (Msg::Req(_), State::Ready(m)) => Some(Msg::Ack(m)),
            (Msg::Req(_), State::Staged(why)) => Some(Msg::Refuse(why)),
            (Msg::Ack(m), State::Sent { .. }) => {
                self.state = State::Ready(m);
                None
            }
            (Msg::NotReady, State::Sent { tries }) => {
                let tries = tries + 1;
                self.state = if tries >= MAX_TRIES {
                    State::Staged(format!(
                        "the peer's GPU was not ready after {tries} requests"
                    ))
                } else {
                    State::Init { tries }
                };
                None
            }
            (Msg::Refuse(why), State::Sent { .. }) => {
                self.state = State::Staged(format!("refused by the peer: {why}"));
                None
            }
            _ => None,
        }
    }

    fn answer(
        &mut self,
        tries: u32,
        theirs: &Caps,
        mine: &Caps,
        reach: impl Fn(&[u8; 16]) -> bool,
    ) -> Msg {
        match decide(mine, theirs, reach) {
            Verdict::Accept(m) => {
                self.state = State::Ready(m);
                Msg::Ack(m)
            }
            Verdict::NotReady => {
                self.state = State::Init { tries };
                Msg::NotReady
            }
            Verdict::Refuse(why) => {
                self.state = State::Staged(why.clone());
                Msg::Refuse(why)
            }
        }
    }
}

/// Why a handshake message was refused on arrival.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum WireError {
    /// Shorter than its type needs.
    #[error("handshake message truncated")]
    Truncated,
    /// Not a handshake message of this version.
    #[error("not an smcuda handshake message of version {VERSION}")]
    Foreign,
    /// An unknown type or flag.
    #[error("malformed handshake message")]
    Malformed,
}

impl Msg {
    /// The wire form.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = vec![MAGIC, VERSION];
        match self {
            Msg::Req(c) => {
                b.push(1);
                b.extend_from_slice(&c.device);
                let flags =
                    c.ready as u8 | (c.vmm as u8) << 1 | (c.legacy as u8) << 2 | (c.mig as u8) << 3;
                b.push(flags);
                b.extend_from_slice(&c.pidns.to_le_bytes());
            }
            Msg::Ack(m) => {
                b.push(2);
                b.push(match m {
                    Mode::Vmm => 0,
                    Mode::Legacy => 1,
                });
            }
            Msg::NotReady => b.push(3),
            Msg::Refuse(why) => {
                b.push(4);
                let mut end = why.len().min(MAX_REASON);
                while !why.is_char_boundary(end) {
                    end -= 1;
                }
                b.push(end as u8);
                b.extend_from_slice(&why.as_bytes()[..end]);
            }
            Msg::Crossed => b.push(5),
        }
        b
    }

    /// Read a message from a peer.
    pub(crate) fn decode(b: &[u8]) -> Result<Msg, WireError> {
        if b.len() < 3 {
            return Err(WireError::Truncated);
        }
        if b[0] != MAGIC || b[1] != VERSION {
            return Err(WireError::Foreign);
        }
        let body = &b[3..];
        let exact = |n: usize| match body.len() {
            l if l < n => Err(WireError::Truncated),
            l if l > n => Err(WireError::Malformed),
            _ => Ok(()),
        };
        Ok(match b[2] {
            1 => {
                exact(25)?;
                let flags = body[16];
                if flags & !0x0f != 0 {
                    return Err(WireError::Malformed);
                }
                Msg::Req(Caps {
                    device: body[..16].try_into().expect("16 bytes"),
                    ready: flags & 1 != 0,
                    vmm: flags & 2 != 0,
                    legacy: flags & 4 != 0,
                    mig: flags & 8 != 0,
                    pidns: u64::from_le_bytes(body[17..25].try_into().expect("8 bytes")),
                })
            }
            2 => {
                exact(1)?;
                Msg::Ack(match body[0] {
                    0 => Mode::Vmm,
                    1 => Mode::Legacy,
                    _ => return Err(WireError::Malformed),
                })
            }
            3 => {
                exact(0)?;
                Msg::NotReady
            }
            4 => {
                let n = *body.first().ok_or(WireError::Truncated)? as usize;
                exact(1 + n)?;
                if n > MAX_REASON {
                    return Err(WireError::Malformed);
                }
                let why = std::str::from_utf8(&body[1..]).map_err(|_| WireError::Malformed)?;
                Msg::Refuse(why.to_string())
            }
            5 => {
                exact(0)?;
                Msg::Crossed
            }
            _ => return Err(WireError::Malformed),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(vmm: bool, legacy: bool, pidns: u64) -> Caps {
        Caps {
            ready: true,
            device: [7; 16],
            vmm,
            legacy,
            mig: false,
            pidns,
        }
    }
    const ANY: fn(&[u8; 16]) -> bool = |_| true;

    /// Run a whole exchange between two handshakes over an ordered
    /// channel each way, `a` having started (and `b` too if `both`).
    fn run(a: &mut Handshake, ca: &Caps, b: &mut Handshake, cb: &Caps, both: bool) {
        let mut to_b: Vec<Msg> = a.start(ca).into_iter().collect();
        let mut to_a: Vec<Msg> = if both {
            b.start(cb).into_iter().collect()
        } else {
            Vec::new()
        };
        for _ in 0..20 {
            if to_a.is_empty() && to_b.is_empty() {
                return;
            }
            for m in std::mem::take(&mut to_b) {
                to_a.extend(b.on_msg(m, cb, ANY));
            }
            for m in std::mem::take(&mut to_a) {
                to_b.extend(a.on_msg(m, ca, ANY));
            }
        }
        panic!("the exchange did not settle");
    }

    #[test]
    fn both_sides_settle_on_vmm_or_legacy_alike() {
        for (ca, cb, want) in [
            (caps(true, true, 1), caps(true, false, 2), Mode::Vmm),
            (caps(false, true, 1), caps(true, true, 1), Mode::Legacy),
        ] {
            let (mut a, mut b) = (Handshake::new(0, 1), Handshake::new(1, 0));
            run(&mut a, &ca, &mut b, &cb, false);
            assert_eq!(a.mode(), Some(want));
            assert_eq!(b.mode(), Some(want));
            // A settled side answers a repeated request with its outcome.
            assert_eq!(b.on_msg(Msg::Req(ca), &cb, ANY), Some(Msg::Ack(want)));
            assert_eq!(a.start(&ca), None, "no second request once settled");
        }
    }

    #[test]
    fn refusals_carry_their_reason_to_both_sides() {
        let mig = Caps {
            mig: true,
            ..caps(true, true, 1)
        };
        for (ca, cb, needle) in [
            (caps(true, true, 1), mig, "MIG"),
            (caps(false, true, 1), caps(true, true, 2), "PID namespaces"),
            (caps(true, false, 1), caps(false, true, 1), "no kind"),
            // The asker offers nothing (`BTL_SMCUDA_IPC=off` there).
            (
                caps(false, false, 1),
                caps(true, true, 1),
                "offers no CUDA IPC",
            ),
        ] {
            let (mut a, mut b) = (Handshake::new(0, 1), Handshake::new(1, 0));
            run(&mut a, &ca, &mut b, &cb, false);
            let (State::Staged(wa), State::Staged(wb)) = (a.state(), b.state()) else {
                panic!("both staged: {:?} {:?}", a.state(), b.state());
            };
            assert!(wa.contains(needle) && wb.contains(needle), "{wa} / {wb}");
        }
        let mut b = Handshake::new(1, 0);
        let reply = b.on_msg(Msg::Req(caps(true, true, 1)), &caps(true, true, 1), |_| {
            false
        });
        assert!(matches!(reply, Some(Msg::Refuse(w)) if w.contains("cannot access")));
    }

    #[test]
    fn giving_up_stages_an_unsettled_handshake_and_leaves_a_settled_one() {
        let ca = caps(true, true, 1);
        let mut a = Handshake::new(0, 1);
        assert!(a.start(&ca).is_some());
        a.give_up("no answer".into());
        assert_eq!(a.state(), &State::Staged("no answer".into()));
        // A late answer changes nothing, and a new request from the peer
        // learns the outcome.
        assert_eq!(a.on_msg(Msg::Ack(Mode::Vmm), &ca, ANY), None);
        assert_eq!(
            a.on_msg(Msg::Req(ca), &ca, ANY),
            Some(Msg::Refuse("no answer".into()))
        );
        let (mut b, mut c) = (Handshake::new(0, 1), Handshake::new(1, 0));
        run(&mut b, &ca, &mut c, &ca, false);
        b.give_up("late".into());
        assert_eq!(b.mode(), Some(Mode::Vmm));
    }

    #[test]
    fn not_ready_is_retried_then_given_up_after_the_limit() {
        let (mut a, mut b) = (Handshake::new(0, 1), Handshake::new(1, 0));
        let ca = caps(true, true, 1);
        let not_up = Caps { ready: false, ..ca };
        for i in 1..MAX_TRIES {
            run(&mut a, &ca, &mut b, &not_up, false);
            assert_eq!(a.state(), &State::Init { tries: i });
        }
        // Ready now: the next try succeeds.
        let mut a2 = a.clone();
        run(&mut a2, &ca, &mut b.clone(), &ca, false);
        assert_eq!(a2.mode(), Some(Mode::Vmm));
        // Not ready one more time: staged for good.
        run(&mut a, &ca, &mut b, &not_up, false);
        assert!(matches!(a.state(), State::Staged(w) if w.contains("not ready")));
        assert_eq!(a.start(&ca), None);
    }

    #[test]
    fn crossing_requests_are_broken_by_rank() {
        for (ra, rb) in [(0, 1), (3, 2)] {
            let ca = caps(true, true, 1);
            let (mut a, mut b) = (Handshake::new(ra, rb), Handshake::new(rb, ra));
            let ra_req = a.start(&ca).unwrap();
            let rb_req = b.start(&ca).unwrap();
            let from_b = b.on_msg(ra_req, &ca, ANY).unwrap();
            let from_a = a.on_msg(rb_req, &ca, ANY).unwrap();
            // The lower rank says Crossed; the higher answers.
            let (lower_says, higher_says) = if ra < rb {
                (&from_a, &from_b)
            } else {
                (&from_b, &from_a)
            };
            assert_eq!(lower_says, &Msg::Crossed);
            assert_eq!(higher_says, &Msg::Ack(Mode::Vmm));
            assert_eq!(a.on_msg(from_b, &ca, ANY), None);
            assert_eq!(b.on_msg(from_a, &ca, ANY), None);
            assert_eq!((a.mode(), b.mode()), (Some(Mode::Vmm), Some(Mode::Vmm)));
        }
        // Both ways, through the runner.
        let c = caps(true, true, 1);
        let (mut a, mut b) = (Handshake::new(5, 9), Handshake::new(9, 5));
        run(&mut a, &c, &mut b, &c, true);
        assert_eq!((a.mode(), b.mode()), (Some(Mode::Vmm), Some(Mode::Vmm)));
    }

    #[test]
    fn answers_out_of_turn_change_nothing() {
        let c = caps(true, true, 1);
        let mut a = Handshake::new(0, 1);
        for m in [
            Msg::Ack(Mode::Legacy),
            Msg::NotReady,
            Msg::Refuse("x".into()),
            Msg::Crossed,
        ] {
            assert_eq!(a.on_msg(m, &c, ANY), None);
            assert_eq!(a.state(), &State::Init { tries: 0 });
        }
        a.start(&c);
        assert_eq!(a.on_msg(Msg::Crossed, &c, ANY), None);
        assert_eq!(a.state(), &State::Sent { tries: 0 });
    }

    #[test]
    fn the_wire_form_round_trips_and_refuses_garbage() {
        let long = "é".repeat(150);
        for m in [
            Msg::Req(caps(true, false, u64::MAX)),
            Msg::Req(Caps {
                mig: true,
                ready: false,
                ..caps(false, true, 3)
            }),
            Msg::Ack(Mode::Vmm),
            Msg::Ack(Mode::Legacy),
            Msg::NotReady,
            Msg::Refuse("no".into()),
            Msg::Refuse(long.clone()),
            Msg::Crossed,
        ] {
            let b = m.encode();
            let back = Msg::decode(&b).unwrap();
            match (&m, &back) {
                (Msg::Refuse(w), Msg::Refuse(g)) if w.len() > MAX_REASON => {
                    assert!(w.starts_with(g.as_str()) && g.len() <= MAX_REASON)
                }
                _ => assert_eq!(back, m),
            }
            for cut in 0..b.len() {
                assert!(Msg::decode(&b[..cut]).is_err(), "{m:?} cut at {cut}");
            }
            let mut extra = b.clone();
            extra.push(0);
            assert!(Msg::decode(&extra).is_err());
        }
        assert_eq!(
            Msg::decode(&[MAGIC, VERSION + 1, 3]),
            Err(WireError::Foreign)
        );
        assert_eq!(Msg::decode(&[MAGIC, VERSION, 9]), Err(WireError::Malformed));
        assert_eq!(
            Msg::decode(&[MAGIC, VERSION, 2, 7]),
            Err(WireError::Malformed)
        );
    }
}

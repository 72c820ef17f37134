//! Lent messages: [`Endpoint::send_region`](crate::Endpoint::send_region)
//! of device memory to a peer whose device memory a transport reaches.
//!
//! The bytes are not carried: the sender announces them (`Kind::Lent`,
//! on the user's tag, in order with the pair's other messages on it) with
//! the region's key, where they start in it and how many there are, and
//! keeps the region alive in its table ([`Lending`]). The receiver takes
//! the announcement as a [`Message`](crate::Message) that
//! [`is_lent`](crate::Message::is_lent), and lands the bytes where it
//! chooses ([`Message::fetch_into`](crate::Message::fetch_into),
//! [`Receiver::recv_region`](crate::Receiver::recv_region)): a get from the
//! sender's region, which between device memories of one node is one GPU
//! copy (`smcuda`), else the host-staged path. Then it answers
//! (`Kind::LentDone`), and the sender's future resolves: `Ok` when the
//! bytes were taken, [`Error::Declined`] when the message was dropped
//! unread, taken by a receive that only takes carried bytes, or its copy
//! failed. A lost receiver fails the sender's future with
//! [`Error::PeerLost`].
//!
//! This is the seed's (`btl_smcuda`) send of GPU memory: the receiver
//! copies from the sender's buffer through IPC, and says when it is done.
//!
//! Wire forms (little-endian):
//! * announcement, kind `Kind::Lent`, tag = the user's tag:
//!   `[VERSION][id u64][offset u64][len u64][key]`, the key as
//!   [`RemoteKey::to_bytes`] writes it;
//! * answer, kind `Kind::LentDone`, tag = the id:
//!   `[status u8][reason, UTF-8, at most MAX_REASON bytes]`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::core::completion::Completion;
use crate::core::fabric::Core;
use crate::core::region::{RegionInner, RemoteKey};
use crate::sys::sync::lock;
use crate::{Error, Rank, Result};

/// The announcement's format version.
const VERSION: u8 = 1;
/// Bytes of an announcement before its key.
const HEAD: usize = 1 + 8 + 8 + 8;
/// The longest reason an answer carries (longer ones are cut).
pub(crate) const MAX_REASON: usize = 200;

/// An announcement, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Announce {
    /// The sender's number for it, echoed in the answer.
    pub(crate) id: u64,
    /// Where the bytes start in the key's region.
    pub(crate) offset: u64,
    /// How many there are.
    pub(crate) len: u64,
    /// The sender's region.
    pub(crate) key: RemoteKey,
}

impl Announce {
    /// Its wire form.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let key = self.key.to_bytes();
        let mut v = Vec::with_capacity(HEAD + key.len());
        v.push(VERSION);
        v.extend_from_slice(&self.id.to_le_bytes());
        v.extend_from_slice(&self.offset.to_le_bytes());
        v.extend_from_slice(&self.len.to_le_bytes());
        v.extend_from_slice(&key);
        v
    }

    /// Read an announcement from `src`: the version, a key `src` owns,
    /// and a range inside it; anything else is an error naming what.
    pub(crate) fn decode(src: Rank, b: &[u8]) -> std::result::Result<Announce, String> {
        if b.len() < HEAD {
            return Err(format!("a lent-message announcement of {} bytes", b.len()));
        }
        if b[0] != VERSION {
            return Err(format!("a lent-message announcement of version {}", b[0]));
        }
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(w)
        };
        let (id, offset, len) = (word(1), word(9), word(17));
        let key = RemoteKey::from_bytes(&b[HEAD..]).map_err(|e| e.to_string())?;
        if key.owner() != src {
            return Err(format!(
                "a lent message whose key belongs to rank {}",
                key.owner()
            ));
        }
        let end = offset
            .checked_add(len)
            .ok_or("a lent range that overflows")?;
        if end > key.len() {
            return Err(format!(
                "a lent range {offset}..{end} outside its {}-byte region",
                key.len()
            ));
        }
        Ok(Announce {
            id,
            offset,
            len,
            key,
        })
    }
}

/// What a receiver did with a lent message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The bytes are in the receiver's memory.
    Taken,
    /// Not taken, and why (dropped unread, the copy failed, ...).
    Declined(String),
}

const TAKEN: u8 = 0;
const DECLINED: u8 = 1;

impl Answer {
    /// Its wire form.
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self {
            Answer::Taken => vec![TAKEN],
            Answer::Declined(why) => {
                let mut end = why.len().min(MAX_REASON);
                while !why.is_char_boundary(end) {
                    end -= 1;
                }
                let mut v = Vec::with_capacity(1 + end);
                v.push(DECLINED);
                v.extend_from_slice(&why.as_bytes()[..end]);
                v
            }
        }
    }

    /// Read an answer; anything but the two forms is an error.
    pub(crate) fn decode(b: &[u8]) -> std::result::Result<Answer, &'static str> {
        match b.split_first() {
            Some((&TAKEN, [])) => Ok(Answer::Taken),
            Some((&DECLINED, why)) if why.len() <= MAX_REASON => std::str::from_utf8(why)
                .map(|w| Answer::Declined(w.to_string()))
                .map_err(|_| "a lent-message answer whose reason is not UTF-8"),
            _ => Err("a malformed lent-message answer"),
        }
    }
}

/// A send whose bytes a peer has yet to take.
struct Loan {
    peer: Rank,
    /// Kept alive until the answer, whatever the future's owner drops.
    region: Arc<RegionInner>,
    done: Arc<Completion>,
}

/// The sender's table of lent messages; on the receiving side, the lent
/// messages held here and the answers that wait for a copy to finish.
#[derive(Default)]
pub(crate) struct Lending {
    next: AtomicU64,
    loans: Mutex<HashMap<u64, Loan>>,
    /// Declines of lent messages dropped while a copy out of the sender's
    /// region was still running: sent once it is done, so the sender
    /// never lets go of memory the copy still reads.
    deferred: Mutex<Vec<Deferred>>,
    /// The lent messages this rank received and has not answered (weakly:
    /// the user holds them), declined all at once when it closes.
    held: Mutex<Vec<Weak<Borrowed>>>,
    /// Regions of answered loans whose last handle the loan held: let go
    /// of on the heartbeat, not on the receive path that took the answer
    /// (freeing device memory can wait for the device).
    graveyard: Mutex<Vec<Arc<RegionInner>>>,
}

/// A decline that waits for a copy: the copy, the sender, the lent
/// message's id, the reason.
type Deferred = (Arc<Completion>, Rank, u64, String);

impl Lending {
    /// Record a loan of `region` to `peer`, completed through `done`:
    /// its id, or `None` if `gone()` says the peer is lost. (Checked under
    /// the table's lock: a loss marks the peer gone before it fails the
    /// table's loans, so no loan is recorded after that sweep.)
    pub(crate) fn lend(
        &self,
        peer: Rank,
        region: Arc<RegionInner>,
        done: Arc<Completion>,
        gone: impl Fn() -> bool,
    ) -> Option<u64> {
        let mut loans = lock(&self.loans);
        if gone() {
            return None;
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        loans.insert(id, Loan { peer, region, done });
        Some(id)
    }

    /// Whether any loan waits for its answer.
    pub(crate) fn has_loans(&self) -> bool {
        !lock(&self.loans).is_empty()
    }

    /// Let go of a finished loan's region: on the heartbeat if the loan
    /// held its last handle.
    fn bury(&self, region: Arc<RegionInner>) {
        if Arc::strong_count(&region) == 1 {
            lock(&self.graveyard).push(region);
        }
    }

    /// Let go of the regions of finished loans.
    pub(crate) fn sweep(&self) {
        let dead = std::mem::take(&mut *lock(&self.graveyard));
        drop(dead);
    }

    /// Keep `b` (a lent message received here) to be declined at close.
    pub(crate) fn hold(&self, b: &Arc<Borrowed>) {
        let mut held = lock(&self.held);
        if held.len() >= 64 && held.len().is_power_of_two() {
            held.retain(|w| w.upgrade().is_some_and(|b| !b.is_answered()));
        }
        held.push(Arc::downgrade(b));
    }

    /// Decline every lent message received here and not answered yet.
    pub(crate) fn decline_held(&self, why: &str) {
        let held: Vec<Arc<Borrowed>> = std::mem::take(&mut *lock(&self.held))
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for b in held {
            b.decline_now(why.to_string());
        }
    }

    /// Forget loan `id` (its announcement could not be sent).
    pub(crate) fn cancel(&self, id: u64) {
        lock(&self.loans).remove(&id);
    }

    /// `src` answered loan `id` with `data`. A malformed answer, or one
    /// for a loan `src` does not hold, is an error naming what.
    pub(crate) fn answered(
        &self,
        src: Rank,
        id: u64,
        data: &[u8],
    ) -> std::result::Result<(), String> {
        let answer = Answer::decode(data)?;
        let loan = {
            let mut loans = lock(&self.loans);
            match loans.get(&id) {
                Some(l) if l.peer == src => loans.remove(&id),
                _ => None,
            }
        };
        let Some(loan) = loan else {
            return Err(format!(
                "an answer to lent message {id}, which it does not hold"
            ));
        };
        loan.done.complete(match answer {
            Answer::Taken => Ok(()),
            Answer::Declined(why) => Err(Error::Declined { rank: src, why }),
        });
        self.bury(loan.region);
        Ok(())
    }

    /// Fail every loan to `peer` with `err()`.
    pub(crate) fn fail(&self, peer: Option<Rank>, err: impl Fn() -> Error) {
        let taken: Vec<Loan> = {
            let mut loans = lock(&self.loans);
            let ids: Vec<u64> = loans
                .iter()
                .filter(|(_, l)| peer.map_or(true, |p| l.peer == p))
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| loans.remove(id)).collect()
        };
        for l in taken {
            l.done.complete(Err(err()));
            self.bury(l.region);
        }
    }

    /// Answer `src`'s lent message `id` with a decline once `copy` is
    /// done (see [`Core::answer_deferred`]).
    fn defer(&self, copy: Arc<Completion>, src: Rank, id: u64, why: String) {
        lock(&self.deferred).push((copy, src, id, why));
    }

    /// The deferred declines whose copies are done, taken out.
    pub(crate) fn ready_declines(&self) -> Vec<(Rank, u64, String)> {
        let mut d = lock(&self.deferred);
        let mut ready = Vec::new();
        d.retain(|(c, src, id, why)| {
            if c.is_done() {
                ready.push((*src, *id, why.clone()));
                false
            } else {
                true
            }
        });
        ready
    }

    /// Loans still waiting for their answer.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        lock(&self.loans).len()
    }
}

/// A lent message as its receiver holds it: the announcement, and the way
/// to answer it. The last clone to go without the bytes taken answers
/// that they were not.
pub(crate) struct Borrowed {
    pub(crate) src: Rank,
    pub(crate) ann: Announce,
    core: Weak<Core>,
    answered: AtomicBool,
    /// Why the message is declined if dropped unread (set when a receive
    /// that takes only carried bytes met it).
    why: Mutex<Option<String>>,
    /// The copy out of the sender's region started for it (one at a time:
    /// a fetch waits for an earlier one), whose end an answer waits for.
    copy: Mutex<Option<Arc<Completion>>>,
}

impl std::fmt::Debug for Borrowed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lent")
            .field("src", &self.src)
            .field("len", &self.ann.len)
            .finish()
    }
}

impl Borrowed {
    /// The announcement `ann` from `src`, answered through `core`.
    pub(crate) fn new(src: Rank, ann: Announce, core: Weak<Core>) -> Borrowed {
        Borrowed {
            src,
            ann,
            core,
            answered: AtomicBool::new(false),
            why: Mutex::new(None),
            copy: Mutex::new(None),
        }
    }

    /// Start a copy out of the sender's region with `start` (which
    /// returns the copy's completion, if it runs on, and its future),
    /// unless one is still running: then `Err` with that one's
    /// completion, to wait for before trying again. One copy at a time,
    /// so the answer after a copy comes after every copy.
    pub(crate) fn begin<T>(
        &self,
        start: impl FnOnce() -> (Option<Arc<Completion>>, T),
    ) -> std::result::Result<T, Arc<Completion>> {
        let mut copy = lock(&self.copy);
        if let Some(c) = copy.as_ref().filter(|c| !c.is_done()) {
            return Err(c.clone());
        }
        let (c, f) = start();
        *copy = c;
        Ok(f)
    }

    /// The fabric, while it is open.
    pub(crate) fn core(&self) -> Result<Arc<Core>> {
        self.core.upgrade().ok_or(Error::Closed)
    }

    /// Answer the sender (once; later calls do nothing).
    pub(crate) fn answer(&self, a: Answer) {
        if self.answered.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(core) = self.core.upgrade() {
            core.answer_lent(self.src, self.ann.id, &a);
        }
    }

    /// Whether the bytes were taken (or declined) already.
    pub(crate) fn is_answered(&self) -> bool {
        self.answered.load(Ordering::Acquire)
    }

    /// Decline with `why` when dropped unread.
    pub(crate) fn decline_with(&self, why: String) {
        *lock(&self.why) = Some(why);
    }

    /// Decline now with `why` (once the copy under way, if any, is done).
    pub(crate) fn decline_now(&self, why: String) {
        let running = lock(&self.copy).take().filter(|c| !c.is_done());
        match running {
            Some(c) => {
                if self.answered.swap(true, Ordering::AcqRel) {
                    return;
                }
                if let Some(core) = self.core.upgrade() {
                    core.lending.defer(c, self.src, self.ann.id, why);
                }
            }
            None => self.answer(Answer::Declined(why)),
        }
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        if self.is_answered() {
            return;
        }
        let why = lock(&self.why)
            .take()
            .unwrap_or_else(|| "the receiver dropped the message without taking its bytes".into());
        self.decline_now(why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::region::{no_nic, MemoryRegion, RegionTable};

    fn region(owner: Rank, len: usize) -> MemoryRegion {
        Arc::new(RegionTable::default()).register(owner, vec![0u8; len], &no_nic)
    }

    fn key(owner: Rank, len: usize) -> RemoteKey {
        region(owner, len).remote_key()
    }

    #[test]
    fn an_announcement_reads_back_and_refuses_what_is_not_one() {
        let a = Announce {
            id: 7,
            offset: 100,
            len: 900,
            key: key(3, 1000),
        };
        let b = a.encode();
        assert_eq!(Announce::decode(3, &b), Ok(a.clone()));
        // Another owner, a range past the region, a short head, another
        // version, trailing bytes after the key.
        assert!(Announce::decode(2, &b).unwrap_err().contains("rank 3"));
        let long = Announce {
            len: 901,
            ..a.clone()
        }
        .encode();
        assert!(Announce::decode(3, &long).unwrap_err().contains("outside"));
        let wrap = Announce {
            offset: u64::MAX,
            ..a.clone()
        }
        .encode();
        assert!(Announce::decode(3, &wrap).is_err());
        assert!(Announce::decode(3, &b[..HEAD - 1]).is_err());
        let mut v2 = b.clone();
        v2[0] = 2;
        assert!(Announce::decode(3, &v2).unwrap_err().contains("version 2"));
        let mut extra = b.clone();
        extra.push(0);
        assert!(Announce::decode(3, &extra).is_err());
    }

    #[test]
    fn answers_read_back_cut_their_reason_and_refuse_the_rest() {
        for a in [Answer::Taken, Answer::Declined("too small".into())] {
            assert_eq!(Answer::decode(&a.encode()), Ok(a));
        }
        let long = Answer::Declined("é".repeat(MAX_REASON)).encode();
        assert!(long.len() <= 1 + MAX_REASON);
        assert!(matches!(Answer::decode(&long), Ok(Answer::Declined(_))));
        assert!(Answer::decode(&[]).is_err());
        assert!(Answer::decode(&[TAKEN, 1]).is_err());
        assert!(Answer::decode(&[DECLINED, 0xff]).is_err());
        assert!(Answer::decode(&[9]).is_err());
    }

    #[test]
    fn a_loan_ends_by_its_own_peers_answer_or_its_loss_only() {
        let lending = Lending::default();
        let region = region(0, 64).inner;
        let (a, b) = (Completion::new(), Completion::new());
        let ia = lending
            .lend(1, region.clone(), a.clone(), || false)
            .unwrap();
        lending
            .lend(2, region.clone(), b.clone(), || false)
            .unwrap();
        // No loan to a peer already gone.
        assert!(lending
            .lend(3, region, Completion::new(), || true)
            .is_none());
        // Rank 2 cannot answer rank 1's loan, nor a loan twice.
        assert!(lending.answered(2, ia, &Answer::Taken.encode()).is_err());
        assert!(lending.answered(1, ia, &[7]).is_err());
        assert!(!a.is_done());
        lending.answered(1, ia, &Answer::Taken.encode()).unwrap();
        assert_eq!(a.take_done().map(|r| r.is_ok()), Some(true));
        assert!(lending.answered(1, ia, &Answer::Taken.encode()).is_err());
        lending.fail(Some(2), || Error::PeerLost {
            rank: 2,
            reason: "test".into(),
        });
        assert!(matches!(b.take_done(), Some(Err(Error::PeerLost { .. }))));
        assert_eq!(lending.len(), 0);
    }
}

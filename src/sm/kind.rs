//! The kinds of message on `sm`'s wire: the core's
//! ([`crate::transport::Kind`], under the same numbers) and `sm`'s own —
//! the rendezvous of large messages and the single-copy put and get —
//! which never leave this transport. Numbers from [`OWN`] up are `sm`'s.

use crate::transport::Kind as CoreKind;

/// The first number of `sm`'s own kinds (the core's stay below it).
pub(crate) const OWN: u8 = 64;

/// A message kind as `sm` carries it in fragment headers and its queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// [`CoreKind::User`] (never held by [`Kind::Core`]).
    User,
    /// Any other kind of the core, carried for it (put/get/atomic
    /// requests and answers, barrier, goodbye): its number.
    Core(CoreKind),
    /// A large user message announced, not carried (rendezvous): where the
    /// receiver reads it from the sender's memory by single copy. Travels
    /// in order with user messages.
    UserCma,
    /// The receiver's refusal of a [`Kind::UserCma`] copy (then the sender
    /// sends the data as [`Kind::CmaData`]); a copy that worked is answered
    /// through the pair's done word.
    CmaDone,
    /// The data of a refused [`Kind::UserCma`], carried after all.
    CmaData,
    /// The receiver of a [`Kind::UserCma`] asks the sender to write the
    /// message's tail into its buffer while it reads the head (split
    /// copy): handle, destination address, offset and length.
    CmaSplit,
    /// put by single copy: the target checks the key, then reads the data
    /// straight from the initiator's memory (`process_vm_readv`).
    PutCma,
    /// get by single copy: the target checks the key, then writes into the
    /// initiator's memory (`process_vm_writev`).
    GetCma,
    /// The target's answer to [`Kind::PutCma`] or [`Kind::GetCma`].
    CmaAck,
}

impl Kind {
    /// The byte in a fragment header.
    pub(crate) fn to_u8(self) -> u8 {
        match self {
            Kind::User => CoreKind::User as u8,
            Kind::Core(k) => k as u8,
            Kind::UserCma => OWN,
            Kind::CmaDone => OWN + 1,
            Kind::CmaData => OWN + 2,
            Kind::CmaSplit => OWN + 3,
            Kind::PutCma => OWN + 4,
            Kind::GetCma => OWN + 5,
            Kind::CmaAck => OWN + 6,
        }
    }

    /// Decode a fragment header's kind byte.
    pub(crate) fn from_u8(b: u8) -> Option<Kind> {
        if b < OWN {
            return CoreKind::from_u8(b).map(Kind::from);
        }
        Some(match b - OWN {
            0 => Kind::UserCma,
            1 => Kind::CmaDone,
            2 => Kind::CmaData,
            3 => Kind::CmaSplit,
            4 => Kind::PutCma,
            5 => Kind::GetCma,
            6 => Kind::CmaAck,
            _ => return None,
        })
    }

    /// The core's kind, for a message the core handles.
    pub(crate) fn core(self) -> Option<CoreKind> {
        match self {
            Kind::User => Some(CoreKind::User),
            Kind::Core(k) => Some(k),
            _ => None,
        }
    }
}

impl From<CoreKind> for Kind {
    fn from(k: CoreKind) -> Kind {
        match k {
            CoreKind::User => Kind::User,
            k => Kind::Core(k),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_byte_round_trips_and_own_kinds_stay_out_of_the_core() {
        let mut seen = 0;
        for b in 0..=u8::MAX {
            if let Some(k) = Kind::from_u8(b) {
                assert_eq!(k.to_u8(), b);
                assert_eq!(k.core().is_some(), b < OWN, "{k:?}");
                seen += 1;
            }
        }
        assert_eq!(seen, 15 + 7);
    }
}

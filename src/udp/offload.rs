//! UDP segmentation offload (GSO) on the way out, receive coalescing (GRO)
//! on the way in.
//!
//! Over a path whose MTU is below 64 KiB (any Ethernet: 1500 or 9000
//! bytes), a large message leaves as many datagrams of one size, and each
//! one pays the whole network stack on both sides. With GSO one `sendmsg`
//! hands the kernel up to [`MAX_SEGS`] of them back to back, with their
//! size in a `UDP_SEGMENT` control message; the stack carries them as one
//! packet and cuts them apart only at the device (in the NIC, or in
//! software at the last moment). With GRO (`UDP_GRO` set on the socket),
//! the kernel may hand a receiver several datagrams of one flow joined in
//! one buffer, with their size in a control message; [`RecvBatch`] cuts
//! them apart again. Every datagram keeps its own protocol header and
//! checksum, so neither changes the protocol: a peer without them talks to
//! a peer with them.
//!
//! Only the data socket uses them (the priority socket carries small
//! datagrams), and GSO only towards peers whose datagrams are small enough
//! for two to share a packet. Both are probed when the socket is made. A
//! GSO send the kernel refuses (a device without checksum offload answers
//! `EIO`; a route whose MTU is below the interface's, `EINVAL`) turns GSO
//! off towards that peer, for good: said once per peer, and sent again
//! without it ([`Gso`]). Other peers, behind another device or route, keep
//! it.
//! `BTL_UDP_GSO=0` turns both off.
//!
//! [`RecvBatch`]: super::io::RecvBatch

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// `UDP_SEGMENT` (`linux/udp.h`): the segment size of a GSO send.
pub(crate) const UDP_SEGMENT: libc::c_int = 103;
/// `UDP_GRO` (`linux/udp.h`): a socket option, and the control message
/// that carries the segment size of a coalesced receive.
pub(crate) const UDP_GRO: libc::c_int = 104;
/// Most datagrams in one GSO send (the kernel's `UDP_MAX_SEGMENTS`).
pub(crate) const MAX_SEGS: usize = 64;
/// Most bytes in one GSO send: what one IP packet carries as UDP payload
/// (65507 over IPv4), less a margin that keeps IPv6 extension headers in.
pub(crate) const MAX_BYTES: usize = 65_000;

/// Offload state of the data socket.
#[derive(Debug, Default)]
pub(crate) struct Offload {
    /// The kernel takes GSO sends on this socket (probed once).
    gso: bool,
    /// `UDP_GRO` is set: a receive may hold several datagrams.
    gro: bool,
    /// Sends that went out as one GSO packet of several datagrams.
    pub(crate) gso_sends: AtomicU64,
    /// Receives that held several datagrams joined by GRO.
    pub(crate) gro_receives: AtomicU64,
    /// GSO sends the kernel refused (each turned GSO off towards its
    /// peer).
    pub(crate) refusals: AtomicU64,
}

impl Offload {
    /// Probe what the kernel offers on `fd` (both off unless `want`).
    pub(crate) fn probe(fd: RawFd, want: bool) -> Offload {
        if !want {
            return Offload::default();
        }
        Offload {
            gso: gso_supported(fd),
            gro: set_int(fd, UDP_GRO, 1),
            ..Offload::default()
        }
    }

    /// Whether the socket may send GSO packets (each peer has its own say
    /// too: see [`Gso`]).
    pub(crate) fn gso(&self) -> bool {
        self.gso
    }

    /// Whether receives may hold coalesced datagrams.
    pub(crate) fn gro(&self) -> bool {
        self.gro
    }
}

/// GSO towards one peer: the socket's offload state and the peer's own
/// switch, which a refused GSO send to that peer turns off (the path to
/// another peer may take them: another device, another route).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gso<'a> {
    pub(crate) off: &'a Offload,
    pub(crate) allowed: &'a AtomicBool,
}

impl Gso<'_> {
    /// Whether sends to the peer may use GSO now.
    pub(crate) fn on(&self) -> bool {
        self.off.gso() && self.allowed.load(Ordering::Relaxed)
    }

    /// The kernel refused a GSO send to `dst`: stop using GSO towards that
    /// peer (said once per peer).
    pub(crate) fn refused(&self, e: &io::Error, dst: std::net::SocketAddr) {
        self.off.refusals.fetch_add(1, Ordering::Relaxed);
        if self.allowed.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                "udp: the kernel refused a segmentation-offload (GSO) send to {dst} ({e}); \
                 sending to it datagram by datagram from now on"
            );
        }
    }
}

/// Whether a failed GSO send says the kernel or the device cannot do GSO
/// (rather than a passing failure, which the protocol's retransmission
/// covers).
pub(crate) fn refusal(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EIO | libc::EINVAL | libc::EMSGSIZE | libc::ENOPROTOOPT | libc::EOPNOTSUPP)
    )
}

/// Whether the kernel knows `UDP_SEGMENT` (Linux 4.18 and later).
fn gso_supported(fd: RawFd) -> bool {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are live for the call and `len` says how many
    // bytes `v` holds; the kernel writes at most that.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_UDP,
            UDP_SEGMENT,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    r == 0
}

fn set_int(fd: RawFd, opt: libc::c_int, v: libc::c_int) -> bool {
    // SAFETY: the option value is a live c_int of the length given; the
    // kernel only reads it.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_UDP,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    r == 0
}

/// How many of the datagrams whose lengths are `lens` go out in the first
/// GSO packet: a run of one length, at most [`MAX_SEGS`] of them and
/// [`MAX_BYTES`] together, which a shorter one may end (the kernel cuts
/// the packet every `lens[0]` bytes, so only the last may be shorter).
/// At least one when `lens` is not empty.
pub(crate) fn group(lens: &[usize]) -> usize {
    let Some(&size) = lens.first() else {
        return 0;
    };
    let mut n = 1;
    let mut total = size;
    if size == 0 || size > usize::from(u16::MAX) {
        return 1;
    }
    while n < lens.len() && n < MAX_SEGS {
        let l = lens[n];
        if l == 0 || l > size || total + l > MAX_BYTES {
            break;
        }
        n += 1;
        total += l;
        if l < size {
            break;
        }
    }
    n
}

/// A control-message buffer with room for one `int` (aligned for
/// `cmsghdr`).
#[derive(Clone, Copy, Default)]
#[repr(C, align(8))]
pub(crate) struct Ctl(pub(crate) [u8; 32]);

/// The segment size a received message's control data (`ctl`, the
/// `msg_controllen` bytes the kernel left) reports (`UDP_GRO`), or 0 when
/// it has none. Read from bytes, bounds-checked: no pointer is followed.
pub(crate) fn gro_segment(ctl: &[u8]) -> usize {
    let word = std::mem::size_of::<usize>();
    let hsize = std::mem::size_of::<libc::cmsghdr>();
    let align = |n: usize| n.div_ceil(word) * word;
    let int = |b: &[u8]| b.try_into().map(libc::c_int::from_ne_bytes).ok();
    let mut at = 0;
    // Each message: its length (a size_t), level and type (ints), padding
    // to the header's alignment, then its data; the next one starts at the
    // length rounded up (the kernel's CMSG_ALIGN).
    while at + hsize <= ctl.len() {
        let h = &ctl[at..at + hsize];
        let Some(len) = h[..word].try_into().ok().map(usize::from_ne_bytes) else {
            return 0;
        };
        let (level, ty) = (int(&h[word..word + 4]), int(&h[word + 4..word + 8]));
        if len < hsize || at + len > ctl.len() {
            return 0;
        }
        if level == Some(libc::SOL_UDP) && ty == Some(UDP_GRO) && len >= hsize + 4 {
            return int(&ctl[at + hsize..at + hsize + 4])
                .and_then(|v| usize::try_from(v).ok())
                .unwrap_or(0);
        }
        at += align(len);
    }
    0
}

/// Fill `ctl` with a `UDP_SEGMENT` control message for segments of `size`
/// bytes; returns the control length to put in the message header.
pub(crate) fn segment_cmsg(ctl: &mut Ctl, size: u16) -> usize {
    put_cmsg(ctl, UDP_SEGMENT, &size.to_ne_bytes())
}

/// Write one `SOL_UDP` control message of type `ty` carrying `data` (at
/// most 8 bytes) at the start of `ctl`; returns its space.
fn put_cmsg(ctl: &mut Ctl, ty: libc::c_int, data: &[u8]) -> usize {
    let n = data.len().min(8) as u32;
    // SAFETY: CMSG_SPACE/CMSG_LEN only compute sizes.
    let (space, len) = unsafe { (libc::CMSG_SPACE(n) as usize, libc::CMSG_LEN(n) as usize) };
    ctl.0 = [0; 32];
    let hdr = libc::cmsghdr {
        cmsg_len: len as _,
        cmsg_level: libc::SOL_UDP,
        cmsg_type: ty,
    };
    let hsize = len - n as usize;
    debug_assert!(space <= ctl.0.len() && hsize >= std::mem::size_of::<libc::cmsghdr>());
    // SAFETY: `Ctl` is 8-aligned and 32 bytes long, so a cmsghdr (16
    // bytes, 8-aligned on the 64-bit targets we build for; smaller
    // elsewhere) fits at its start.
    unsafe { std::ptr::write(ctl.0.as_mut_ptr().cast::<libc::cmsghdr>(), hdr) };
    // The data follows the padded header (CMSG_LEN(n) - n bytes in).
    ctl.0[hsize..hsize + n as usize].copy_from_slice(&data[..n as usize]);
    space
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_turns_gso_off_towards_that_peer_only() {
        let off = Offload {
            gso: true,
            ..Offload::default()
        };
        let (a, b) = (AtomicBool::new(true), AtomicBool::new(true));
        let (ga, gb) = (
            Gso {
                off: &off,
                allowed: &a,
            },
            Gso {
                off: &off,
                allowed: &b,
            },
        );
        assert!(ga.on() && gb.on());
        let e = io::Error::from_raw_os_error(libc::EINVAL);
        assert!(refusal(&e));
        ga.refused(&e, "192.0.2.1:9".parse().unwrap());
        assert!(!ga.on() && gb.on(), "only the refused peer loses GSO");
        ga.refused(&e, "192.0.2.1:9".parse().unwrap());
        assert_eq!(
            off.refusals.load(Ordering::Relaxed),
            2,
            "every refusal counted"
        );
        // A socket without GSO sends none to anyone.
        let none = Offload::default();
        assert!(!Gso {
            off: &none,
            allowed: &b
        }
        .on());
    }

    #[test]
    fn groups_are_runs_of_one_size_that_a_shorter_one_may_end() {
        assert_eq!(group(&[]), 0);
        assert_eq!(group(&[100]), 1);
        assert_eq!(group(&[100, 100, 100]), 3);
        assert_eq!(group(&[100, 100, 60, 100]), 3);
        assert_eq!(group(&[100, 120, 100]), 1);
        assert_eq!(group(&[100, 100, 120]), 2);
        assert_eq!(group(&[0, 0]), 1);
        assert_eq!(group(&[100, 0, 100]), 1);
        assert_eq!(group(&vec![1000; 200]), 64);
        assert_eq!(group(&vec![1472; 200]), 44);
        assert_eq!(group(&[70_000, 70_000]), 1);
    }

    #[test]
    fn a_group_never_breaks_the_kernels_rules() {
        // Every prefix of every mix of a few lengths: only the last datagram
        // of a group may be shorter, none longer, within the caps.
        let sizes = [1usize, 7, 1000, 1472, 8000, 32_768];
        for &a in &sizes {
            for &b in &sizes {
                let lens: Vec<usize> = (0..150).map(|i| if i % 37 == 36 { b } else { a }).collect();
                let mut at = 0;
                while at < lens.len() {
                    let n = group(&lens[at..]);
                    assert!((1..=MAX_SEGS).contains(&n));
                    let g = &lens[at..at + n];
                    assert!(g.iter().sum::<usize>() <= MAX_BYTES.max(g[0]));
                    assert!(g[..n - 1].iter().all(|&l| l == g[0]));
                    assert!(g[n - 1] <= g[0]);
                    at += n;
                }
            }
        }
    }

    #[test]
    fn control_messages_read_back() {
        let read = |ctl: &mut Ctl, len: usize| gro_segment(&ctl.0[..len]);
        let mut ctl = Ctl::default();
        // A UDP_SEGMENT message is not a GRO one; nothing, neither.
        let len = segment_cmsg(&mut ctl, 1472);
        assert_eq!(read(&mut ctl, len), 0);
        assert_eq!(read(&mut ctl, 0), 0);
        let len = put_cmsg(&mut ctl, UDP_GRO, &1472i32.to_ne_bytes());
        assert_eq!(read(&mut ctl, len), 1472);
        let len = put_cmsg(&mut ctl, UDP_GRO, &(-5i32).to_ne_bytes());
        assert_eq!(read(&mut ctl, len), 0);
        // A GRO message behind another one is found; a length that runs
        // past the data, or is too short to be a header, ends the search.
        let mut two = [0u8; 64];
        let first = put_cmsg(&mut ctl, UDP_SEGMENT, &7u16.to_ne_bytes());
        two[..first].copy_from_slice(&ctl.0[..first]);
        let second = put_cmsg(&mut ctl, UDP_GRO, &1000i32.to_ne_bytes());
        two[first..first + second].copy_from_slice(&ctl.0[..second]);
        assert_eq!(gro_segment(&two[..first + second]), 1000);
        let mut bad = two;
        bad[..8].copy_from_slice(&1000usize.to_ne_bytes());
        assert_eq!(gro_segment(&bad[..first + second]), 0);
        bad[..8].copy_from_slice(&3usize.to_ne_bytes());
        assert_eq!(gro_segment(&bad[..first + second]), 0);
        assert_eq!(gro_segment(&two[..first + 19]), 0);
    }
}

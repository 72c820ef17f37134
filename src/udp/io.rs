//! Batched datagram I/O on the two sockets: `recvmmsg` and `sendmmsg`
//! through tokio's readiness (`try_io`), so a `WouldBlock` clears readiness
//! and `readable()`/`writable()` wake us when there is more to do. A hot
//! poller also asks a socket when tokio does not hold it readable
//! (`recv_now`, `recv_one_now`).
//!
//! On the data socket, sends of several datagrams of one size go out as
//! GSO packets and receives may hold GRO-coalesced datagrams, which
//! [`RecvBatch::iter`] cuts apart (see `offload`). On loopback a datagram
//! is already 64 KiB, so neither has anything to join there.

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;

use socket2::SockAddr;
use tokio::io::Interest;
use tokio::net::UdpSocket;

use super::offload::{self, Ctl, Gso};
use super::proto;

/// Datagrams moved per system call.
pub(crate) const BATCH: usize = 16;
/// Parts of an outgoing datagram, sent without joining them: header,
/// payload (a slice of the user's message), trailer (CRC or MAC).
pub(crate) const PARTS: usize = 3;
/// One outgoing datagram, in parts (see [`PARTS`]).
pub(crate) type Parts<'a> = [&'a [u8]; PARTS];
/// Size of a receive buffer: the largest UDP payload fits.
const RECV_BUF: usize = 65_536;

/// Header bytes of a DATA datagram, received apart by [`recv_in_place`].
const HEAD: usize = proto::DATA_HEADER_LEN;

/// Receive buffers for one `recvmmsg` call, reused across calls.
pub(crate) struct RecvBatch {
    bufs: Vec<Vec<u8>>,
    lens: [usize; BATCH],
    from: [Option<SocketAddr>; BATCH],
    n: usize,
    /// Datagrams before this one landed in a lent buffer
    /// ([`recv_in_place`]); [`iter`](Self::iter) starts here.
    first: usize,
    /// Per datagram that landed: its header bytes...
    heads: [[u8; HEAD]; BATCH],
    /// ...and where its payload lies in the lent buffer (offset, length).
    at: [(usize, usize); BATCH],
    /// Per received buffer: the size of the datagrams GRO joined in it, or
    /// 0 when it holds one datagram.
    seg: [usize; BATCH],
    /// Control-message space per buffer (GRO reports the size there).
    ctl: [Ctl; BATCH],
    /// Buffers of the last call that held several datagrams.
    pub(crate) coalesced: usize,
    /// Length of the job's datagram trailer (see `proto::Guard`).
    trailer: usize,
}

impl RecvBatch {
    /// Buffers for datagrams whose trailers are `trailer` bytes long.
    pub(crate) fn new(trailer: usize) -> RecvBatch {
        RecvBatch {
            trailer,
            bufs: (0..BATCH).map(|_| vec![0u8; RECV_BUF]).collect(),
            lens: [0; BATCH],
            from: [None; BATCH],
            n: 0,
            first: 0,
            heads: [[0; HEAD]; BATCH],
            at: [(0, 0); BATCH],
            seg: [0; BATCH],
            ctl: [Ctl::default(); BATCH],
            coalesced: 0,
        }
    }

    /// Start a call: nothing received yet.
    fn reset(&mut self) {
        self.n = 0;
        self.first = 0;
        self.coalesced = 0;
    }

    /// Point `hdr` at buffer `i`'s control space (for GRO's report).
    fn aim_ctl(&mut self, i: usize, hdr: &mut libc::msghdr) {
        hdr.msg_control = self.ctl[i].0.as_mut_ptr().cast();
        hdr.msg_controllen = self.ctl[i].0.len() as _;
    }

    /// Note the segment size GRO reported for buffer `i` of `len` bytes.
    fn note_seg(&mut self, i: usize, hdr: &libc::msghdr, len: usize) {
        // (`hdr` was aimed at `ctl[i]`; the kernel says how much it wrote
        // there, which is read as bytes.)
        // (`msg_controllen` is a size_t in glibc, a socklen_t elsewhere.)
        #[allow(clippy::unnecessary_cast)]
        let n = (hdr.msg_controllen as usize).min(self.ctl[i].0.len());
        let seg = offload::gro_segment(&self.ctl[i].0[..n]);
        self.seg[i] = if seg > 0 && len > seg { seg } else { 0 };
        self.coalesced += usize::from(self.seg[i] > 0);
    }

    /// The datagrams of the last call, with their source addresses (those
    /// that landed in a lent buffer excepted: see [`landed`](Self::landed)).
    /// A buffer GRO filled with several datagrams yields each of them.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (Option<SocketAddr>, &[u8])> {
        (self.first..self.n).flat_map(move |i| {
            let d = &self.bufs[i][..self.lens[i]];
            let seg = match self.seg[i] {
                0 => d.len().max(1),
                s => s,
            };
            (0..d.len().div_ceil(seg).max(1)).map(move |k| {
                (
                    self.from[i],
                    &d[(k * seg).min(d.len())..((k + 1) * seg).min(d.len())],
                )
            })
        })
    }

    /// The datagrams of the last [`recv_in_place`] that landed in the lent
    /// buffer as expected, in arrival order (each trailer came first in
    /// its overflow buffer).
    pub(crate) fn landed(&self) -> impl Iterator<Item = proto::Landed<'_>> {
        (0..self.first).map(|i| proto::Landed {
            head: &self.heads[i],
            at: self.at[i].0,
            len: self.at[i].1,
            trailer: proto::Trailer::from_slice(&self.bufs[i][..self.trailer]),
        })
    }
}

/// Receive up to [`BATCH`] datagrams, asking the kernel whatever tokio's
/// readiness says (as [`recv_now`]), with each datagram's payload aimed
/// straight at the spare room of `buf` (a message being reassembled): the
/// `i`th datagram's first [`HEAD`] bytes go to a header buffer, its next
/// bytes to `buf` at `buf.len() + i * chunk` (at most `chunk` of them, and
/// nothing past `remaining` bytes), the rest to an overflow buffer. A
/// datagram from `expect` that filled its place exactly and left just its
/// trailer in the overflow buffer is taken as landed: `buf`'s length grows
/// over those places, in order, up to the first datagram that did not
/// (whatever it is: the protocol checks each one that landed, and joins
/// and handles normally any that is not what it should be). Every other
/// datagram is joined into its overflow buffer, for
/// [`RecvBatch::iter`]. Returns the number of datagrams.
pub(crate) fn recv_in_place(
    sock: &UdpSocket,
    b: &mut RecvBatch,
    buf: &mut Vec<u8>,
    chunk: usize,
    remaining: usize,
    expect: SocketAddr,
) -> io::Result<usize> {
    b.reset();
    let base = buf.len();
    let room = (buf.capacity() - base).min(remaining);
    let chunk = chunk.max(1);
    let k = room.div_ceil(chunk).min(BATCH);
    if k == 0 {
        return recv_now(sock, b);
    }
    let place = |i: usize| chunk.min(room - i * chunk);
    // The spare room of `buf`, written only through the kernel below.
    let spare = buf.spare_capacity_mut().as_mut_ptr().cast::<u8>();
    // SAFETY: all-zero bytes are a valid value of these plain C structs.
    let mut names: [libc::sockaddr_storage; BATCH] = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut iovs: [[libc::iovec; 3]; BATCH] = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut hdrs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
    for i in 0..k {
        iovs[i][0].iov_base = b.heads[i].as_mut_ptr().cast();
        iovs[i][0].iov_len = HEAD;
        // SAFETY: i * chunk + place(i) <= room <= the spare capacity, so
        // the pointer stays inside `buf`'s allocation.
        iovs[i][1].iov_base = unsafe { spare.add(i * chunk) }.cast();
        iovs[i][1].iov_len = place(i);
        iovs[i][2].iov_base = b.bufs[i].as_mut_ptr().cast();
        iovs[i][2].iov_len = b.bufs[i].len();
        hdrs[i].msg_hdr.msg_name = (&mut names[i] as *mut libc::sockaddr_storage).cast();
        hdrs[i].msg_hdr.msg_namelen =
            std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        hdrs[i].msg_hdr.msg_iov = iovs[i].as_mut_ptr();
        hdrs[i].msg_hdr.msg_iovlen = 3;
        b.aim_ctl(i, &mut hdrs[i].msg_hdr);
    }
    let fd = sock.as_raw_fd();
    let call = |hdrs: &mut [libc::mmsghdr; BATCH]| {
        // SAFETY: every header points at three iovecs covering live,
        // writable memory of their lengths (header buffer, spare room of
        // `buf` that nothing else uses during the call, overflow buffer),
        // at a sockaddr_storage of msg_namelen bytes and at a control
        // buffer of msg_controllen bytes, all of which outlive the call;
        // the kernel writes at most that.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                hdrs.as_mut_ptr(),
                k as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    };
    let mut asked = false;
    let r = sock.try_io(Interest::READABLE, || {
        asked = true;
        call(&mut hdrs)
    });
    let r = if asked { r } else { call(&mut hdrs) };
    let n = match finish(r, b) {
        Ok(n) => n.min(k),
        Err(e) => return Err(e),
    };
    b.n = n;
    let mut landed = 0;
    let mut at = base;
    for i in 0..n {
        let len = hdrs[i].msg_len as usize;
        b.from[i] = to_addr(&names[i], hdrs[i].msg_hdr.msg_namelen);
        b.lens[i] = len.min(RECV_BUF);
        b.note_seg(i, &hdrs[i].msg_hdr, len);
        // (Datagrams GRO joined never land: they are joined below and cut
        // apart by `iter`.)
        if landed == i
            && b.seg[i] == 0
            && b.from[i] == Some(expect)
            && len == HEAD + place(i) + b.trailer
        {
            b.at[i] = (at, place(i));
            at += place(i);
            landed += 1;
        }
    }
    for i in landed..n {
        // Join the datagram in its overflow buffer: header bytes, then the
        // bytes that went to its place in `buf`, then the rest.
        let len = b.lens[i];
        let head = len.min(HEAD);
        let mid = (len - head).min(place(i));
        let tail = len - head - mid;
        let v = &mut b.bufs[i];
        v.copy_within(..tail, head + mid);
        v[..head].copy_from_slice(&b.heads[i][..head]);
        // SAFETY: the kernel wrote `mid` bytes at that place of the spare
        // room (the datagram's length says so), so they are initialized;
        // they lie inside `buf`'s allocation (see above) and do not overlap
        // the overflow buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(spare.add(i * chunk), v.as_mut_ptr().add(head), mid)
        };
    }
    b.first = landed;
    // SAFETY: the datagrams before `landed` each filled their place in the
    // spare room completely (their length says so, and the kernel fills
    // the iovecs in order), and those places are contiguous from `base`:
    // every byte below `at` is initialized. (`spare` is not used after
    // this.)
    unsafe { buf.set_len(at) };
    Ok(n)
}

/// Receive up to [`BATCH`] datagrams without blocking; `Ok(0)` when none.
/// Asks the kernel only when tokio's readiness says the socket may have
/// data (no system call otherwise).
pub(crate) fn recv(sock: &UdpSocket, b: &mut RecvBatch) -> io::Result<usize> {
    b.reset();
    let r = sock.try_io(Interest::READABLE, || recvmmsg(sock.as_raw_fd(), b));
    finish(r, b)
}

/// Like [`recv`], but asks the kernel whatever tokio's readiness says: a
/// poller that expects data finds it as soon as it lands, without waiting
/// for the runtime's next `epoll_wait` to notice. When tokio holds the
/// socket readable, the call goes through `try_io`, which clears that
/// readiness if nothing is there, against the readiness it read *before*
/// the call (so a datagram that lands meanwhile, and the edge the reactor
/// records for it, is never forgotten); otherwise the call is made
/// directly and there is no readiness to clear.
pub(crate) fn recv_now(sock: &UdpSocket, b: &mut RecvBatch) -> io::Result<usize> {
    ask_now(sock, b, recvmmsg)
}

/// Like [`recv_now`], for one datagram only, with `recvfrom`: the cheapest
/// way to ask a socket that is usually empty (a hot poll waiting for the
/// next message).
///
/// On a socket with GRO on (`gro`), with `recvmsg` instead: a receive may
/// then hold several datagrams, and only its control data says so.
pub(crate) fn recv_one_now(sock: &UdpSocket, b: &mut RecvBatch, gro: bool) -> io::Result<usize> {
    ask_now(sock, b, if gro { recvmsg } else { recvfrom })
}

/// Run the receive `call` on `sock` now, through `try_io` when tokio holds
/// the socket readable (see [`recv_now`]), directly otherwise.
fn ask_now(
    sock: &UdpSocket,
    b: &mut RecvBatch,
    call: fn(std::os::fd::RawFd, &mut RecvBatch) -> io::Result<usize>,
) -> io::Result<usize> {
    b.reset();
    let fd = sock.as_raw_fd();
    let mut asked = false;
    let r = sock.try_io(Interest::READABLE, || {
        asked = true;
        call(fd, b)
    });
    let r = if asked { r } else { call(fd, b) };
    finish(r, b)
}

/// One non-blocking `recvfrom` into `b`'s first buffer.
fn recvfrom(fd: std::os::fd::RawFd, b: &mut RecvBatch) -> io::Result<usize> {
    // SAFETY: all-zero bytes are a valid sockaddr_storage.
    let mut name: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let buf = &mut b.bufs[0];
    // SAFETY: the buffer is live and writable for its length, `name` and
    // `len` are live for the call and `len` says how much `name` holds; the
    // kernel writes at most that.
    let n = unsafe {
        libc::recvfrom(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
            (&mut name as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    };
    if n < 0 {
        return Err(receive_error());
    }
    b.lens[0] = (n as usize).min(RECV_BUF);
    b.from[0] = to_addr(&name, len);
    b.seg[0] = 0;
    Ok(1)
}

/// The error of the receive call that just failed. The usual answer of a
/// hot poll is checked by number: a plain WouldBlock is cheaper to match
/// than an OS error's kind.
fn receive_error() -> io::Error {
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EAGAIN) {
        io::ErrorKind::WouldBlock.into()
    } else {
        e
    }
}

/// One non-blocking `recvmsg` into `b`'s first buffer, with room for
/// GRO's control message.
fn recvmsg(fd: std::os::fd::RawFd, b: &mut RecvBatch) -> io::Result<usize> {
    // SAFETY: all-zero bytes are a valid value of these plain C structs.
    let mut name: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    let mut iov = libc::iovec {
        iov_base: b.bufs[0].as_mut_ptr().cast(),
        iov_len: b.bufs[0].len(),
    };
    hdr.msg_name = (&mut name as *mut libc::sockaddr_storage).cast();
    hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    b.aim_ctl(0, &mut hdr);
    // SAFETY: the header points at one iovec over a live buffer of its
    // length, at a sockaddr_storage of msg_namelen bytes and at a control
    // buffer of msg_controllen bytes, all live for the call; the kernel
    // writes at most that.
    let n = unsafe { libc::recvmsg(fd, &mut hdr, libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(receive_error());
    }
    let len = (n as usize).min(RECV_BUF);
    b.lens[0] = len;
    b.from[0] = to_addr(&name, hdr.msg_namelen);
    b.note_seg(0, &hdr, len);
    Ok(1)
}

fn finish(r: io::Result<usize>, b: &mut RecvBatch) -> io::Result<usize> {
    match r {
        Ok(n) => {
            b.n = n;
            Ok(n)
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
        Err(e) => Err(e),
    }
}

/// One non-blocking `recvmmsg` into `b`'s buffers.
fn recvmmsg(fd: std::os::fd::RawFd, b: &mut RecvBatch) -> io::Result<usize> {
    // SAFETY: all-zero bytes are a valid value of these plain C structs.
    let mut names: [libc::sockaddr_storage; BATCH] = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut iovs: [libc::iovec; BATCH] = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut hdrs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
    for i in 0..BATCH {
        iovs[i].iov_base = b.bufs[i].as_mut_ptr().cast();
        iovs[i].iov_len = b.bufs[i].len();
        hdrs[i].msg_hdr.msg_name = (&mut names[i] as *mut libc::sockaddr_storage).cast();
        hdrs[i].msg_hdr.msg_namelen =
            std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        hdrs[i].msg_hdr.msg_iov = &mut iovs[i];
        hdrs[i].msg_hdr.msg_iovlen = 1;
        b.aim_ctl(i, &mut hdrs[i].msg_hdr);
    }
    // SAFETY: every header points at one iovec covering a live buffer of
    // iov_len bytes, at a sockaddr_storage of msg_namelen bytes and at a
    // control buffer of msg_controllen bytes, all of which outlive the
    // call; the kernel writes at most that.
    let n = unsafe {
        libc::recvmmsg(
            fd,
            hdrs.as_mut_ptr(),
            BATCH as libc::c_uint,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let n = n as usize;
    for i in 0..n {
        let len = (hdrs[i].msg_len as usize).min(RECV_BUF);
        b.lens[i] = len;
        b.from[i] = to_addr(&names[i], hdrs[i].msg_hdr.msg_namelen);
        b.note_seg(i, &hdrs[i].msg_hdr, len);
    }
    Ok(n)
}

/// The source address the kernel wrote into `s` (`len` bytes of it), as
/// the peer table keys it: `sockaddr_in` gives an IPv4 address,
/// `sockaddr_in6` an IPv6 one. Anything else, or a name too short for its
/// family, gives `None` (the datagram is dropped and counted).
///
/// The IPv6 flow label and scope id are not kept: peers are keyed by
/// address and port alone (the exchange publishes no scope, and link-local
/// addresses are refused, see `net::unusable`). An IPv4-mapped source
/// (`::ffff:a.b.c.d`) is kept as the IPv6 address it is, never turned into
/// IPv4: it can only come from a dual-stack socket (ours are
/// `IPV6_V6ONLY`, so the kernel delivers none), and it then matches no
/// peer, not even the IPv4 peer with the same address and port.
fn to_addr(s: &libc::sockaddr_storage, len: libc::socklen_t) -> Option<SocketAddr> {
    let len = len as usize;
    match i32::from(s.ss_family) {
        libc::AF_INET if len >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: the family says the storage holds a sockaddr_in, which
            // is smaller than sockaddr_storage and less strictly aligned.
            let a = unsafe { &*(s as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Some(SocketAddr::from((ip, u16::from_be(a.sin_port))))
        }
        libc::AF_INET6 if len >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: the family says the storage holds a sockaddr_in6
            // (and the kernel wrote at least its size), which is smaller
            // than sockaddr_storage and less strictly aligned.
            let a = unsafe { &*(s as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
            Some(SocketAddr::from((ip, u16::from_be(a.sin6_port))))
        }
        _ => None,
    }
}

/// Send datagrams to `dst` without blocking. Returns how many left (a prefix
/// of `bufs`); fewer than asked when the socket buffer is full. A datagram
/// the kernel refuses for another reason is skipped (counted as sent): the
/// protocol retransmits what matters.
///
/// With `gso` (the data socket's offload state and the peer's switch) and
/// GSO on, runs of datagrams of one size leave as GSO packets, several per
/// `sendmmsg`; a refused GSO send turns GSO off towards the peer and is
/// sent again without it.
pub(crate) fn send(
    sock: &UdpSocket,
    dst: SocketAddr,
    bufs: &[Parts<'_>],
    gso: Option<Gso<'_>>,
) -> usize {
    let addr = SockAddr::from(dst);
    let fd = sock.as_raw_fd();
    let mut done = 0;
    while done < bufs.len() {
        let off = gso.filter(|g| g.on() && bufs.len() - done > 1);
        // The datagrams' lengths, for GSO's runs.
        let lens: Vec<usize> = match off {
            Some(_) => bufs[done..]
                .iter()
                .map(|p| p.iter().map(|part| part.len()).sum())
                .collect(),
            None => Vec::new(),
        };
        // Whether the first message of the call is a GSO packet: only its
        // failure is reported (`sendmmsg` returns the count when any went
        // out), and only a GSO packet's says anything about GSO.
        let first_gso = off.is_some() && offload::group(&lens) > 1;
        let chunk = &bufs[done..bufs.len().min(done + BATCH)];
        let r = sock.try_io(Interest::WRITABLE, || match (off, chunk) {
            (Some(_), _) => sendmmsg_gso(fd, &addr, &bufs[done..], &lens),
            (None, [one]) => sendmsg(fd, &addr, one).map(|n| (n, 0)),
            (None, _) => sendmmsg(fd, &addr, chunk).map(|n| (n, 0)),
        });
        match r {
            Ok((n, packets)) => {
                done += n.max(1).min(bufs.len() - done);
                if let Some(g) = off {
                    g.off
                        .gso_sends
                        .fetch_add(packets as u64, std::sync::atomic::Ordering::Relaxed);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                if let Some(g) = off.filter(|_| first_gso && offload::refusal(&e)) {
                    // Sent again, datagram by datagram, on the next turn.
                    g.refused(&e, dst);
                    continue;
                }
                tracing::debug!("udp: datagram to {dst} refused by the kernel: {e}");
                done += 1;
            }
        }
    }
    done
}

/// Datagrams from the start of `bufs` (whose lengths are `lens`) in at
/// most [`BATCH`] messages of one `sendmmsg`: each message a GSO packet of
/// a run of one size (see `offload::group`), or a lone datagram. Returns
/// the datagrams the kernel took and how many of the messages it took
/// were GSO packets.
fn sendmmsg_gso(
    fd: std::os::fd::RawFd,
    addr: &SockAddr,
    bufs: &[Parts<'_>],
    lens: &[usize],
) -> io::Result<(usize, usize)> {
    // (start, count) of each message.
    let mut groups = [(0usize, 0usize); BATCH];
    let mut g = 0;
    let mut at = 0;
    while at < bufs.len() && g < BATCH {
        let n = offload::group(&lens[at..]);
        groups[g] = (at, n);
        at += n;
        g += 1;
    }
    let mut iovs: Vec<libc::iovec> = bufs[..at]
        .iter()
        .flatten()
        .map(|part| libc::iovec {
            iov_base: part.as_ptr() as *mut libc::c_void,
            iov_len: part.len(),
        })
        .collect();
    let base = iovs.as_mut_ptr();
    let mut ctl = [Ctl::default(); BATCH];
    // SAFETY: all-zero bytes are a valid value of this plain C struct.
    let mut hdrs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
    for (i, &(start, n)) in groups[..g].iter().enumerate() {
        let h = &mut hdrs[i].msg_hdr;
        h.msg_name = addr.as_ptr() as *mut libc::c_void;
        h.msg_namelen = addr.len();
        // SAFETY: the groups cover `bufs[..at]` in order, so `start *
        // PARTS + n * PARTS <= iovs.len()`: the pointer and the run after
        // it stay inside `iovs`, which is not touched again before the
        // call.
        h.msg_iov = unsafe { base.add(start * PARTS) };
        h.msg_iovlen = n * PARTS;
        if n > 1 {
            // `group` keeps every size of a run within u16.
            let size = u16::try_from(lens[start]).unwrap_or(u16::MAX);
            h.msg_controllen = offload::segment_cmsg(&mut ctl[i], size) as _;
            h.msg_control = ctl[i].0.as_mut_ptr().cast();
        }
    }
    // SAFETY: each header points at its datagrams' iovecs (inside `iovs`,
    // over buffers that outlive the call), at the destination address and,
    // for a GSO packet, at a control buffer holding one UDP_SEGMENT
    // message of msg_controllen bytes; sendmmsg only reads them (and
    // writes msg_len in the headers).
    let m = unsafe { libc::sendmmsg(fd, hdrs.as_mut_ptr(), g as libc::c_uint, libc::MSG_DONTWAIT) };
    if m < 0 {
        return Err(io::Error::last_os_error());
    }
    let took = &groups[..(m as usize).min(g)];
    Ok((
        took.iter().map(|&(_, n)| n).sum(),
        took.iter().filter(|&&(_, n)| n > 1).count(),
    ))
}

/// A lone datagram (the latency path): plain `sendmsg`, which does less
/// work in the kernel than a one-entry `sendmmsg`, with only its own
/// header and iovecs to fill. Returns 1 when sent.
fn sendmsg(fd: std::os::fd::RawFd, addr: &SockAddr, parts: &Parts<'_>) -> io::Result<usize> {
    let mut iovs = parts.map(|part| libc::iovec {
        iov_base: part.as_ptr() as *mut libc::c_void,
        iov_len: part.len(),
    });
    // SAFETY: all-zero bytes are a valid msghdr (null pointers, zero
    // lengths); the fields that matter are set below.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_name = addr.as_ptr() as *mut libc::c_void;
    hdr.msg_namelen = addr.len();
    hdr.msg_iov = iovs.as_mut_ptr();
    hdr.msg_iovlen = PARTS;
    // SAFETY: the header points at PARTS iovecs over live buffers and at
    // the destination address, all outliving the call; sendmsg only reads
    // them.
    let n = unsafe { libc::sendmsg(fd, &hdr, libc::MSG_DONTWAIT) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(1)
    }
}

/// Several datagrams (at most [`BATCH`]) with one `sendmmsg`. Returns how
/// many the kernel took.
fn sendmmsg(fd: std::os::fd::RawFd, addr: &SockAddr, chunk: &[Parts<'_>]) -> io::Result<usize> {
    // SAFETY: all-zero bytes are a valid value of these C structs.
    let mut iovs: [[libc::iovec; PARTS]; BATCH] = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut hdrs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
    let chunk = &chunk[..chunk.len().min(BATCH)];
    for (i, parts) in chunk.iter().enumerate() {
        for (iov, part) in iovs[i].iter_mut().zip(parts) {
            iov.iov_base = part.as_ptr() as *mut libc::c_void;
            iov.iov_len = part.len();
        }
        hdrs[i].msg_hdr.msg_name = addr.as_ptr() as *mut libc::c_void;
        hdrs[i].msg_hdr.msg_namelen = addr.len();
        hdrs[i].msg_hdr.msg_iov = iovs[i].as_mut_ptr();
        hdrs[i].msg_hdr.msg_iovlen = PARTS;
    }
    // SAFETY: each header points at PARTS iovecs over live buffers and at
    // the destination address, all outliving the call; sendmmsg only reads
    // them (and writes msg_len in the headers).
    let n = unsafe {
        libc::sendmmsg(
            fd,
            hdrs.as_mut_ptr(),
            chunk.len() as libc::c_uint,
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::udp::offload::Offload;
    use std::sync::atomic::AtomicBool;

    /// A datagram of the in-place shape: `HEAD` header bytes, `payload`
    /// bytes, a trailer of `TRAILER` bytes, each filled with its own
    /// pattern.
    fn dgram(tag: u8, payload: usize) -> Vec<u8> {
        let mut d = vec![tag; HEAD];
        d.extend((0..payload).map(|i| tag.wrapping_add(i as u8)));
        d.extend_from_slice(&[tag ^ 0xff; TRAILER]);
        d
    }

    /// The trailer of the datagrams these tests send: a MAC's, the longer.
    const TRAILER: usize = proto::MAX_TRAILER;

    #[test]
    fn datagrams_land_in_place_only_in_order_from_the_expected_source() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        rt.block_on(async {
            let rx = UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let to = rx.local_addr().unwrap();
            let a = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let b = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let mut batch = RecvBatch::new(TRAILER);
            let chunk = 100;
            // Two that fit their places, one from elsewhere, one short,
            // then one that would fit again (after a miss: joined too).
            let sent = [
                (&a, dgram(1, chunk)),
                (&a, dgram(2, chunk)),
                (&b, dgram(3, chunk)),
                (&a, dgram(4, 50)),
                (&a, dgram(5, chunk)),
            ];
            for (s, d) in &sent {
                s.send_to(d, to).unwrap();
            }
            let mut buf = Vec::with_capacity(1000);
            buf.extend_from_slice(&[9u8; 10]);
            let n = recv_in_place(
                &rx,
                &mut batch,
                &mut buf,
                chunk,
                1000,
                a.local_addr().unwrap(),
            )
            .unwrap();
            assert_eq!(n, 5);
            // The first two landed, in order, after what was there.
            assert_eq!(buf.len(), 10 + 2 * chunk);
            assert_eq!(&buf[..10], &[9u8; 10]);
            let landed: Vec<_> = batch.landed().collect();
            assert_eq!(landed.len(), 2);
            for (i, l) in landed.iter().enumerate() {
                let d = &sent[i].1;
                assert_eq!(l.head, &d[..HEAD]);
                assert_eq!((l.at, l.len), (10 + i * chunk, chunk));
                assert_eq!(&buf[l.at..l.at + l.len], &d[HEAD..HEAD + chunk]);
                assert_eq!(l.trailer.as_ref(), &d[d.len() - TRAILER..]);
            }
            // The rest come whole, with their sources.
            let rest: Vec<(Option<SocketAddr>, Vec<u8>)> =
                batch.iter().map(|(f, d)| (f, d.to_vec())).collect();
            let want: Vec<(Option<SocketAddr>, Vec<u8>)> = sent[2..]
                .iter()
                .map(|(s, d)| (Some(s.local_addr().unwrap()), d.clone()))
                .collect();
            assert_eq!(rest, want);

            // Nothing room for: a plain batch, the buffer untouched.
            a.send_to(&dgram(6, chunk), to).unwrap();
            let mut full = vec![1u8; 4];
            full.shrink_to_fit();
            let n = recv_in_place(
                &rx,
                &mut batch,
                &mut full,
                chunk,
                1000,
                a.local_addr().unwrap(),
            )
            .unwrap();
            assert_eq!(n, 1);
            assert_eq!(full, vec![1u8; 4]);
            assert_eq!(batch.landed().count(), 0);
            assert_eq!(
                batch.iter().next().map(|(_, d)| d.to_vec()),
                Some(dgram(6, chunk))
            );
        });
    }

    /// `a` as the kernel writes a source address: a `sockaddr_storage`
    /// and the length of the name in it.
    fn storage_of(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
        let sa = SockAddr::from(a);
        // SAFETY: all-zero bytes are a valid sockaddr_storage.
        let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        // SAFETY: `sa` holds `sa.len()` initialized bytes of a socket
        // address, no more than a sockaddr_storage, which `st` is; the two
        // are distinct objects.
        unsafe {
            std::ptr::copy_nonoverlapping(
                sa.as_ptr().cast::<u8>(),
                (&mut st as *mut libc::sockaddr_storage).cast::<u8>(),
                sa.len() as usize,
            )
        };
        (st, sa.len())
    }

    #[test]
    fn source_addresses_of_both_families_are_read_exactly() {
        for a in [
            "127.0.0.1:4000",
            "[::1]:4000",
            "[fd00::2]:65535",
            "[2001:db8::1]:1",
        ] {
            let a: SocketAddr = a.parse().unwrap();
            let (st, len) = storage_of(a);
            assert_eq!(to_addr(&st, len), Some(a));
            // A name shorter than its family's structure is refused.
            assert_eq!(to_addr(&st, len - 1), None);
        }
        // The mapped form of an IPv4 peer stays IPv6: it is not the peer.
        let v4: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:4000".parse().unwrap();
        let (st, len) = storage_of(mapped);
        let got = to_addr(&st, len).unwrap();
        assert!(got.is_ipv6());
        assert_ne!(got, v4);
        // No family we know.
        // SAFETY: all-zero bytes are a valid sockaddr_storage.
        let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        st.ss_family = libc::AF_UNIX as libc::sa_family_t;
        assert_eq!(to_addr(&st, 110), None);
    }

    #[test]
    fn ipv6_datagrams_come_with_their_source() {
        let Ok(a) = std::net::UdpSocket::bind("[::1]:0") else {
            println!("skipped: cannot bind [::1]:0 (IPv6 disabled on this host?)");
            return;
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        rt.block_on(async {
            let rx = UdpSocket::bind("[::1]:0").await.unwrap();
            let to = rx.local_addr().unwrap();
            let from = a.local_addr().unwrap();
            let mut batch = RecvBatch::new(TRAILER);
            // recvfrom, then recvmmsg, then an in-place batch.
            a.send_to(&dgram(1, 10), to).unwrap();
            assert_eq!(recv_one_now(&rx, &mut batch, false).unwrap(), 1);
            let got: Vec<_> = batch.iter().map(|(f, d)| (f, d.to_vec())).collect();
            assert_eq!(got, vec![(Some(from), dgram(1, 10))]);
            a.send_to(&dgram(2, 10), to).unwrap();
            a.send_to(&dgram(3, 0), to).unwrap();
            assert_eq!(recv_now(&rx, &mut batch).unwrap(), 2);
            let got: Vec<_> = batch.iter().map(|(f, d)| (f, d.to_vec())).collect();
            assert_eq!(
                got,
                vec![(Some(from), dgram(2, 10)), (Some(from), dgram(3, 0))]
            );
            a.send_to(&dgram(4, 100), to).unwrap();
            let mut buf = Vec::with_capacity(1000);
            let n = recv_in_place(&rx, &mut batch, &mut buf, 100, 1000, from).unwrap();
            assert_eq!(n, 1);
            assert_eq!(batch.landed().count(), 1);
            assert_eq!(&buf[..], &dgram(4, 100)[HEAD..HEAD + 100]);
            // Sent through our own send path to an IPv6 destination.
            let d = dgram(5, 7);
            let parts: Parts<'_> = [&d[..HEAD], &d[HEAD..], &[]];
            rx.writable().await.unwrap();
            assert_eq!(send(&rx, from, &[parts, parts], None), 2);
            let mut got = [0u8; 200];
            for _ in 0..2 {
                let (n, src) = a.recv_from(&mut got).unwrap();
                assert_eq!((src, &got[..n]), (to, &d[..]));
            }
        });
    }

    /// A datagram of `len` bytes whose bytes say which one it is.
    fn numbered(i: usize, len: usize) -> Vec<u8> {
        (0..len).map(|k| (i * 7 + k) as u8).collect()
    }

    fn gso<'a>(off: &'a Offload, allowed: &'a AtomicBool) -> Gso<'a> {
        Gso { off, allowed }
    }

    /// Run `f` on a sender with GSO on and a receiver with GRO on, in a
    /// one-thread runtime, if the kernel has them (said why, if not).
    fn with_offload_pair<F: std::future::Future<Output = ()>>(
        f: impl FnOnce(UdpSocket, Offload, UdpSocket) -> F,
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        rt.block_on(async {
            let rx = UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let tx = UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let off_rx = Offload::probe(rx.as_raw_fd(), true);
            let off_tx = Offload::probe(tx.as_raw_fd(), true);
            if !off_tx.gso() || !off_rx.gro() {
                println!("skipped: this kernel has no UDP GSO/GRO");
                return;
            }
            f(tx, off_tx, rx).await;
        });
    }

    #[test]
    fn gso_packets_arrive_whole_and_gro_joined_ones_are_cut_apart() {
        with_offload_pair(|tx, off, rx| async move {
            let to = rx.local_addr().unwrap();
            // Runs of one size, a shorter one now and then (it ends a GSO
            // packet), and one longer one (it starts another).
            let dgrams: Vec<Vec<u8>> = (0..300)
                .map(|i| match i {
                    _ if i % 70 == 69 => numbered(i, 300),
                    150 => numbered(i, 1200),
                    _ => numbered(i, 1000),
                })
                .collect();
            let parts: Vec<Parts<'_>> = dgrams
                .iter()
                .map(|d| [&d[..32], &d[32..d.len() - 4], &d[d.len() - 4..]])
                .collect();
            let mut batch = RecvBatch::new(TRAILER);
            let allowed = AtomicBool::new(true);
            let (mut sent, mut got, mut joined, mut turn) = (0, Vec::new(), 0, 0usize);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while got.len() < dgrams.len() && std::time::Instant::now() < deadline {
                // A few GSO packets at a time, received before the next
                // (the receive buffer is the kernel's default, and UDP
                // drops what does not fit).
                if sent == got.len() {
                    tx.writable().await.unwrap();
                    let most = (sent + 100).min(parts.len());
                    sent += send(&tx, to, &parts[sent..most], Some(gso(&off, &allowed)));
                }
                // Both receive paths: one buffer at a time, and batches.
                turn += 1;
                let n = if turn % 2 == 0 {
                    recv_one_now(&rx, &mut batch, true)
                } else {
                    recv_now(&rx, &mut batch)
                };
                if n.unwrap() > 0 {
                    joined += batch.coalesced;
                    got.extend(batch.iter().map(|(_, d)| d.to_vec()));
                } else {
                    tokio::task::yield_now().await;
                }
            }
            assert_eq!(got.len(), dgrams.len());
            assert!(got == dgrams, "datagrams differ after GSO and GRO");
            let packets = off.gso_sends.load(std::sync::atomic::Ordering::Relaxed);
            assert!(packets >= 6, "only {packets} GSO packets");
            assert!(joined > 0, "no receive held joined datagrams");
        });
    }

    #[test]
    fn a_gro_joined_receive_never_lands_in_place() {
        with_offload_pair(|tx, off, rx| async move {
            let (to, from) = (rx.local_addr().unwrap(), tx.local_addr().unwrap());
            let chunk = 500;
            let sent: Vec<Vec<u8>> = (1..=5).map(|i| dgram(i, chunk)).collect();
            let parts: Vec<Parts<'_>> = sent
                .iter()
                .map(|d| [&d[..HEAD], &d[HEAD..d.len() - 4], &d[d.len() - 4..]])
                .collect();
            tx.writable().await.unwrap();
            let allowed = AtomicBool::new(true);
            assert_eq!(send(&tx, to, &parts, Some(gso(&off, &allowed))), 5);
            let mut batch = RecvBatch::new(TRAILER);
            let mut buf = Vec::with_capacity(10 * chunk);
            buf.extend_from_slice(&[9u8; 10]);
            let mut n = 0;
            for _ in 0..1000 {
                n = recv_in_place(&rx, &mut batch, &mut buf, chunk, 10 * chunk, from).unwrap();
                if n > 0 {
                    break;
                }
                tokio::task::yield_now().await;
            }
            assert!(n > 0);
            let got: Vec<Vec<u8>> = batch.iter().map(|(_, d)| d.to_vec()).collect();
            // With GRO on, loopback delivers the GSO packet whole: nothing
            // landed, and the joined datagrams come out whole.
            assert!(batch.coalesced > 0);
            assert_eq!(batch.landed().count(), 0);
            assert_eq!(buf, vec![9u8; 10]);
            assert_eq!(got, sent);
        });
    }
}

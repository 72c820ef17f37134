//! Batched datagram I/O on the two sockets: `recvmmsg` and `sendmmsg`
//! through tokio's readiness (`try_io`), so a `WouldBlock` clears readiness
//! and `readable()`/`writable()` wake us when there is more to do. A hot
//! poller also asks a socket when tokio does not hold it readable
//! (`recv_now`, `recv_one_now`).
//!
//! GSO/GRO are not used: on loopback a datagram is already 64 KiB (the
//! largest a GSO super-packet may be), so batching syscalls is what helps
//! there; on a 1500-byte path GSO would cut the per-datagram cost further
//! (left for later, see the module docs of `udp`).

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;

use socket2::SockAddr;
use tokio::io::Interest;
use tokio::net::UdpSocket;

/// Datagrams moved per system call.
pub(crate) const BATCH: usize = 16;
/// Parts of an outgoing datagram, sent without joining them: header,
/// payload (a slice of the user's message), checksum trailer.
pub(crate) const PARTS: usize = 3;
/// One outgoing datagram, in parts (see [`PARTS`]).
pub(crate) type Parts<'a> = [&'a [u8]; PARTS];
/// Size of a receive buffer: the largest UDP payload fits.
const RECV_BUF: usize = 65_536;

/// Receive buffers for one `recvmmsg` call, reused across calls.
pub(crate) struct RecvBatch {
    bufs: Vec<Vec<u8>>,
    lens: [usize; BATCH],
    from: [Option<SocketAddr>; BATCH],
    n: usize,
}

impl RecvBatch {
    pub(crate) fn new() -> RecvBatch {
        RecvBatch {
            bufs: (0..BATCH).map(|_| vec![0u8; RECV_BUF]).collect(),
            lens: [0; BATCH],
            from: [None; BATCH],
            n: 0,
        }
    }

    /// The datagrams of the last call, with their source addresses.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (Option<SocketAddr>, &[u8])> {
        (0..self.n).map(|i| (self.from[i], &self.bufs[i][..self.lens[i]]))
    }
}

/// Receive up to [`BATCH`] datagrams without blocking; `Ok(0)` when none.
/// Asks the kernel only when tokio's readiness says the socket may have
/// data (no system call otherwise).
pub(crate) fn recv(sock: &UdpSocket, b: &mut RecvBatch) -> io::Result<usize> {
    b.n = 0;
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
    b.n = 0;
    let fd = sock.as_raw_fd();
    let mut asked = false;
    let r = sock.try_io(Interest::READABLE, || {
        asked = true;
        recvmmsg(fd, b)
    });
    let r = if asked { r } else { recvmmsg(fd, b) };
    finish(r, b)
}

/// Like [`recv_now`], for one datagram only, with `recvfrom`: the cheapest
/// way to ask a socket that is usually empty (a hot poll waiting for the
/// next message).
pub(crate) fn recv_one_now(sock: &UdpSocket, b: &mut RecvBatch) -> io::Result<usize> {
    b.n = 0;
    let fd = sock.as_raw_fd();
    let mut asked = false;
    let r = sock.try_io(Interest::READABLE, || {
        asked = true;
        recvfrom(fd, b)
    });
    let r = if asked { r } else { recvfrom(fd, b) };
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
        let e = io::Error::last_os_error();
        // The usual answer of a hot poll, checked by number: a plain
        // WouldBlock is cheaper to match than an OS error's kind.
        return Err(if e.raw_os_error() == Some(libc::EAGAIN) {
            io::ErrorKind::WouldBlock.into()
        } else {
            e
        });
    }
    b.lens[0] = (n as usize).min(RECV_BUF);
    b.from[0] = to_addr(&name, len);
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
    }
    // SAFETY: every header points at one iovec covering a live buffer of
    // iov_len bytes and at a sockaddr_storage of msg_namelen bytes, all of
    // which outlive the call; the kernel writes at most that.
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
        b.lens[i] = (hdrs[i].msg_len as usize).min(RECV_BUF);
        b.from[i] = to_addr(&names[i], hdrs[i].msg_hdr.msg_namelen);
    }
    Ok(n)
}

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
            // SAFETY: as above, for sockaddr_in6.
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
pub(crate) fn send(sock: &UdpSocket, dst: SocketAddr, bufs: &[Parts<'_>]) -> usize {
    let addr = SockAddr::from(dst);
    let fd = sock.as_raw_fd();
    let mut done = 0;
    while done < bufs.len() {
        let chunk = &bufs[done..bufs.len().min(done + BATCH)];
        let r = sock.try_io(Interest::WRITABLE, || match chunk {
            [one] => sendmsg(fd, &addr, one),
            _ => sendmmsg(fd, &addr, chunk),
        });
        match r {
            Ok(n) => done += n.max(1).min(chunk.len()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::debug!("udp: datagram to {dst} refused by the kernel: {e}");
                done += 1;
            }
        }
    }
    done
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
